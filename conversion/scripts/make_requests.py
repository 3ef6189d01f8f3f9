"""Write conversion/requests.jsonl: the project's own SystemOne requests for `clef-export check-release`.

The requests are written for this project (nothing is copied from anyone's data). Some are sized
to land near a bucket edge once encoded by the author's `encode_record` with the byte-level
tokenizer of the tiny test release (one token per UTF-8 byte, Qwen's markers one token each):
their state is padded with deterministic filler until the encoded length hits the target. With
another tokenizer (a real release) the lengths differ and the requests land in other buckets;
the coverage of types, option counts, levels and question counts does not change.

    python conversion/scripts/make_requests.py --author-code .cache/author/joint_schema_model.py

`tests/test_check_release.py` checks that the file still has the coverage this script aims at.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = "clef-flash"
HERE = Path(__file__).resolve().parent.parent  # conversion/


def choice(instructions: str, options: dict[str, str | None]) -> dict:
    return {"type": "choice", "instructions": instructions, "criteria": options}


def score(instructions: str, levels: list[str]) -> dict:
    return {"type": "score", "instructions": instructions, "criteria": levels}


def noul(instructions: str, criteria: dict[str, str] | None = None) -> dict:
    q = {"type": "noul", "instructions": instructions}
    if criteria is not None:
        q["criteria"] = criteria
    return q


def n_options(n: int) -> dict[str, str]:
    names = {"billing": "Charges.", "shipping": "Delivery.", "returns": None, "account": "Login.", "security": None,
             "product": "Defects.", "warranty": None, "feedback": "Ideas.", "legal": None, "other": None}
    return dict(list(names.items())[:n])


SEVERITY = ["no impact", "minor", "moderate", "major", "critical", "catastrophic", "existential"]


def levels(n: int) -> list[str]:
    return SEVERITY[:n]


TICKET = "Desk (order 88213) came with a cracked leg; two emails unanswered. I want a new leg, not a refund."
YES_NO = {"true": "yes", "false": "no"}
LOG_LINE = "2026-11-{day:02d}T{h:02d}:{m:02d}:{s:02d}Z worker-{w} job={job} status={status} latency_ms={lat}\n"


def filler(n: int, seed: int) -> str:
    """Exactly ``n`` ASCII characters of log lines (deterministic)."""
    out, i = [], 0
    total = 0
    while total < n:
        line = LOG_LINE.format(day=1 + (seed + i) % 28, h=(i * 7) % 24, m=(i * 13) % 60, s=(i * 31) % 60,
                               w=(seed + i) % 5, job=1000 + 17 * i + seed, status=("ok", "retry", "failed")[(i + seed) % 3],
                               lat=20 + (i * 37 + seed) % 900)
        out.append(line)
        total += len(line)
        i += 1
    return "".join(out)[:n]


def requests() -> list[dict]:
    """(request, target length or None); a target pads the state to that many tokens."""
    rs: list[tuple[dict, int | None]] = []

    def add(rid: str, state, questions: dict, target: int | None = None) -> None:
        rs.append(({"id": rid, "model": MODEL, "state": state, "questions": questions}, target))

    # short requests, one to a few questions, every type
    add("ticket-route-2", TICKET, {"escalate": choice("Escalate now?", {"yes": "Act today.", "no": "Can wait."})})
    add("ticket-route-3", TICKET, {"team": choice("Owning team?", n_options(3))})
    add("ticket-topic-4", TICKET, {"topic": choice("What is the ticket about?", n_options(4)),
                                   "angry": noul("Is the customer angry?")})
    add("ticket-topic-5", {"channel": "email", "text": TICKET, "customer_tier": "gold"},
        {"topic": choice("Main topic of the message.", n_options(5))})
    add("ticket-topic-6", {"channel": "chat", "text": TICKET, "previous_contacts": 2},
        {"topic": choice("Main topic of the message.", n_options(6)), "severity": score("How bad is it?", levels(3))})
    add("ticket-topic-7", TICKET, {"topic": choice("Main topic of the message.", n_options(7))})
    add("ticket-topic-8", {"text": TICKET, "locale": "en-GB"}, {"topic": choice("Main topic.", n_options(8))})
    add("ticket-topic-9", TICKET, {"topic": choice("", n_options(9))})  # empty instructions: the id stands in
    add("ticket-topic-10", {"text": TICKET, "attachments": ["IMG_2231.jpg", "IMG_2232.jpg"]},
        {"topic": choice("Main topic of the message.", n_options(10))})
    add("review-score-3", "The patch renames a private helper and updates its two call sites.",
        {"risk": score("Merge risk?", ["low", "medium", "high"])})
    add("review-score-4", {"diff_stats": {"files": 14, "insertions": 912, "deletions": 40}, "tests_added": False},
        {"risk": score("How risky is merging this change?", levels(4)),
         "needs_owner": noul("Does a code owner need to approve it?")})
    add("review-score-5", "Migration drops the column `legacy_id` from `orders` without a backfill.",
        {"risk": score("Data loss risk?", ["0", "1", "2", "3", "4"])})
    add("review-score-6", {"change": "bump TLS library 3.1 -> 3.4", "cves_fixed": 2},
        {"risk": score("Risk of the upgrade.", levels(6)), "urgent": noul("Ship before the weekend?")})
    add("review-score-7", "Feature flag `new_checkout` is switched on for every region at once.",
        {"blast_radius": score("How far would a failure reach?", levels(7))})
    add("moderation-unicode", "Ça coûte 12 € — trop cher ! 这个价格太高了。🙂 Ist das ein Scherz?",
        {"language_mix": noul("Does the message mix three or more languages?",
                              {"true": "Three or more languages appear.", "false": "One or two languages."}),
         "tone": choice("Tone of the message.", {"polite": "Courteous.", "neutral": None, "hostile": "Insulting or threatening."})})
    add("expense-json", {"employee": "E-1042", "items": [{"what": "train", "eur": 142.5}, {"what": "hotel", "eur": 389.0},
                                                         {"what": "dinner", "eur": 96.2}], "policy_limit_eur": 500},
        {"approve": noul("Approve the claim as filed?"),
         "flag": choice("What should the reviewer look at first?",
                        {"b_hotel": "The hotel line.", "a_total": "The total against the limit.",
                         "10_receipts": "Missing receipts.", "9_none": "Nothing."})})
    add("shipping-exception", {"parcel": "JD0142", "events": ["picked up", "in transit", "address not found"],
                               "attempts": 1}, {"next": choice("Next action.", {"retry": "Try delivery again.",
                                                                               "hold": "Hold at the depot.",
                                                                               "return": "Return to sender."}),
                                               "contact": noul("Contact the recipient first?"),
                                               "delay": score("Expected delay.", levels(4))})

    # requests with many questions
    def many(n: int) -> dict:
        # short options (no descriptions, short level names) so that 16 questions fit 4096 tokens
        qs = {}
        for i in range(n):
            kind = i % 3
            if kind == 0:
                qs[f"q{i:02d}"] = noul(f"Check {i} passes?", YES_NO)
            elif kind == 1:
                qs[f"q{i:02d}"] = choice(f"Owner of step {i}.", {f"t{j}": None for j in range(2 + i % 4)})
            else:
                qs[f"q{i:02d}"] = score(f"Rate step {i}.", [str(k) for k in range(3 + i % 2)])
        return qs

    add("audit-8q", {"service": "payments", "window": "2026-11-01/2026-11-29", "incidents": 3}, many(8))
    add("audit-12q", {"service": "search", "incidents": 0, "notes": "quiet month"}, many(12))
    add("audit-16q", {"service": "auth", "incidents": 7, "notes": "two outages, one data exposure review"}, many(16))

    # near the bucket edges (tokens once encoded with the tiny release's byte-level tokenizer)
    add("edge-512-under", "Nightly job report follows.\n", {"healthy": noul("Nightly run healthy?", YES_NO)}, 505)
    add("edge-512-exact", "Nightly job report follows.\n", {"ok": choice("Verdict.", {"pass": None, "fail": None})}, 512)
    add("edge-1024-over", "Weekly job report follows.\n", {"healthy": noul("Weekly run healthy?", YES_NO)}, 513)
    add("edge-1024-exact", "Weekly job report follows.\n", {"owner": choice("Who should look first?", n_options(5))}, 1024)
    add("edge-2048-over", "Monthly job report follows.\n", {"owner": choice("Who should look first?", n_options(6))}, 1025)
    add("edge-2048-exact", "Monthly job report follows.\n", many(6), 2048)
    add("edge-4096-over", "Quarterly job report follows.\n", {"trend": score("Failure trend.", levels(5))}, 2049)
    add("edge-4096-under", "Quarterly job report follows.\n", many(10), 4090)
    add("edge-4096-exact", "Quarterly job report follows.\n", {"healthy": noul("Is the quarter healthy?"),
                                                              "owner": choice("Who owns the follow-up?", n_options(10))},
        4096)

    # requests that do not fit the published pads and buckets (listed, never cut)
    add("too-long-4097", "Yearly job report follows.\n", {"healthy": noul("Is the year healthy?")}, 4097)
    add("too-many-questions-17", {"service": "billing"}, many(17))
    add("too-many-options-130", {"service": "catalog"},
        {f"q{i:02d}": choice(f"Category of item {i}.", {f"c{j}": None for j in range(10)}) for i in range(13)})
    return rs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--author-code", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=HERE / "requests.jsonl")
    args = ap.parse_args()

    from clef_flash.author import AUTHOR_SHA256, load_author_module
    from clef_flash.synth import byte_tokenizer

    module = load_author_module(args.author_code, AUTHOR_SHA256)
    tok = byte_tokenizer()
    lines = []
    for body, target in requests():
        if target is not None:
            base = len(module.encode_record(tok, body).input_ids)
            if base > target:
                raise SystemExit(f"{body['id']}: {base} tokens before padding, target {target}")
            if not isinstance(body["state"], str):
                raise SystemExit(f"{body['id']}: only a text state can be padded to a target")
            body["state"] = body["state"] + filler(target - base, len(lines))
            got = len(module.encode_record(tok, body).input_ids)
            if got != target:
                raise SystemExit(f"{body['id']}: {got} tokens, target {target}")
        lines.append(json.dumps(body, ensure_ascii=False, sort_keys=False))
        print(f"{body['id']:24} {len(body['questions']):3} questions {len(module.encode_record(tok, body).input_ids):6} tokens")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(lines)} requests -> {args.out}")


if __name__ == "__main__":
    main()
