"""Each decoder layer's effect on the answers, estimated from one forward and one reverse sweep of
the uncompressed reference (``plan-weights``' ranking: O(layers), not one end-to-end pass a layer).

Forward: every record through the streamed reference, each layer's output kept on disk
(``sensitivity.LayerOutputs``). Then the head: every option's probability (what the budget's
max |dp| is taken over) and its gradient at the last layer's output. Reverse, one layer's weights
in memory at a time: the layer with its linears compressed, run on its kept input; its difference
``d`` from the kept output is its own error, ``<g, d>`` the first-order change of each option's
probability, ``sum((g * d)**2)`` the diagonal Fisher term (ModelOpt's AutoQuantize score)
reported beside it; then the layer uncompressed, run forward once a record with its graph kept,
and every ``g`` carried back through it by one backward an option.

How it works: docs/modules.md."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .contract import LM, layer_of
from .delta_rule import swapped
from .held_weights import in_blocks
from .sensitivity import Dequantizer, LayerOutputs


@dataclass
class LayerEstimate:
    """One layer's figures over every record: its own error (worst record), the first-order change
    of every option's probability with it alone compressed (signed; one entry per record and
    option, in order), and the Fisher term (the worst option)."""

    rel_max_abs_d: float = 0.0
    rel_rms_d: float = 0.0
    dp: list[float] = field(default_factory=list)
    fisher: float | None = None  # over the records carried back (None: every record measured end to end)

    @property
    def estimated_dp(self) -> float:
        return max((abs(v) for v in self.dp), default=0.0)


@dataclass
class Sweep:
    """What ``reverse_sweep`` found, and the seconds of its three parts (they grow apart with the
    layers: the head's gradients once, the own errors with the compressed layers, the carry-back with
    the layers above the first)."""

    estimates: dict[int, LayerEstimate]
    head_s: float = 0.0  # every option's gradient at the last layer's output
    own_s: float = 0.0  # each compressed layer run compressed: its own error and ``d``
    carry_s: float = 0.0  # the first-order changes and the gradients carried back


def set_estimate(estimates: dict[int, LayerEstimate], squeezed: set[int]) -> float:
    """The first-order max |dp| with ``squeezed`` compressed together: the layers' signed changes
    added per option (first order is linear), the worst option."""
    if not squeezed:
        return 0.0
    total = np.sum([estimates[i].dp for i in sorted(squeezed)], axis=0)
    return float(np.abs(total).max()) if total.size else 0.0


@contextmanager
def one_thread():
    """torch on one CPU thread for the block: the author's head adds in an order that follows the
    thread count (its probabilities moved by 1e-8 between one thread and two, measured), and a
    plan must be the same figure for figure at any thread count. The head is a small part of the
    work; the backbone's layers gave the same bits at one and two threads and keep every thread."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class LayerCalls:
    """What the text model passes each layer besides its hidden states (rotary tables, masks), kept
    per record and layer kind during the forward, so a layer can be run again alone."""

    def __init__(self, ref, layer_types: list[str]) -> None:
        self.by_record: dict[int, dict[str, dict]] = {}
        self.current = 0
        for i, layer in enumerate(ref.model.layers):
            layer.register_forward_pre_hook(self._keep(layer_types[i]), with_kwargs=True)

    def _keep(self, kind: str):
        def hook(module, args, kwargs):
            # no cache: run again alone, a layer must not read the state its first run left there
            kept = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}
            self.by_record.setdefault(self.current, {}).setdefault(kind, kept)
        return hook


# the carry-back through a layer, in forwards of that layer at the 9B's width (the slice, where the
# time goes; docs/performance.md): its forward with the graph kept, once a record (0.69-0.78
# measured), and one backward an option (0.86-0.91)
FORWARD_UNITS = 0.75
BACKWARD_UNITS = 0.9


def measured_alone(options: list[int], layers: int, compressed: list[int]) -> list[int]:
    """The records whose per-layer changes cost less measured end to end than carried back
    (``options``: each record's option count). The sweep runs the record through every layer above
    the first once and carries each option's gradient back through it ((layers - 1) x
    (FORWARD_UNITS + options x BACKWARD_UNITS)); the end-to-end passes run each compressed layer i
    and the layers after it (the sum of layers - i). Both scale with the record's tokens, so the
    choice is the record's options against the layers: at 4 layers a record of 3 options is
    cheaper end to end, at 32 one of 18 is not."""
    end_to_end = sum(layers - i for i in compressed)
    return [r for r, n in enumerate(options) if (layers - 1) * (FORWARD_UNITS + n * BACKWARD_UNITS) > end_to_end]


def _grads_path(outputs: LayerOutputs, record: int, layer: int) -> Path:
    return outputs.path / f"grad-{layer}-{record}.npy"


@contextmanager
def _sdpa(config):
    """The layer's full attention as SDPA for the block (the causal kernel keeps no [heads, T, T] a
    copy); eager again after, where the plan's values are taken."""
    kept = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = kept


@contextmanager
def carrying_back(layer, config, x, kwargs: dict):
    """The layer run forward once on ``x`` ([1, T, H]) with its graph kept; yields ``back``: an
    option's gradient at the layer's output ([1, T, H]) -> at its input, one backward on that graph
    (the graph goes with the block). Every option's forward would be the same: kept, it runs once a
    record, at one option's memory. The gradients are the first-order estimate's, not its values:
    the full attention is SDPA's causal kernel on the unpadded record (the eager mask it replaces is
    the causal one), the linear attention's scan ``delta_rule``'s (the same bits, a backward linear
    in the length), and a streamed linear's weight read by blocks of rows (``held_weights.in_blocks``)."""
    import torch

    xb = x.detach().clone().requires_grad_(True)
    kw = {k: (None if k == "attention_mask" else v) for k, v in kwargs.items()}
    with _sdpa(config), swapped(layer), in_blocks(), torch.enable_grad():
        yb = layer(xb, **kw)
        yb = yb[0] if isinstance(yb, tuple) else yb
        yield lambda g: torch.autograd.grad(yb, xb, g, retain_graph=True)[0]


def forward_pass(ref, records: list[np.ndarray], outputs: LayerOutputs, calls: LayerCalls | None = None,
                 tick=lambda: None) -> list[np.ndarray]:
    """Every record through the uncompressed reference: its final rows, returned, and each layer's
    output, kept in ``outputs`` (with ``calls``, what each layer was passed besides)."""
    current = [0]

    def keep(index: int):
        def after(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            outputs.put(index, current[0], out[0].detach().cpu().numpy())
        return after

    handles = [layer.register_forward_hook(keep(i), with_kwargs=True, prepend=True) for i, layer in enumerate(ref.model.layers)]
    rows = []
    try:
        for r, ids in enumerate(records):
            current[0] = r
            if calls is not None:
                calls.current = r
            rows.append(ref.rows(ids))
            tick()
    finally:
        for h in handles:
            h.remove()
    return rows


def reverse_sweep(ref, records: list[np.ndarray], options, infos, scheme, compressed: list[str], scaled: bool,
                  outputs: LayerOutputs, calls: LayerCalls, layer_types: list[str], back_tick=lambda: None,
                  measured: dict[int, dict[int, np.ndarray]] | None = None, parked=nullcontext) -> Sweep:
    """Each compressed layer's estimate (``Sweep.estimates``), after ``forward_pass`` kept every
    layer's output and what it was passed. ``options(r, rows)`` is the head on record ``r``'s final
    rows (``[1, T, H]``, with grad) -> every option's probability, a 1-D tensor a question.
    ``measured[r][i]``: record ``r``'s signed changes with layer ``i`` alone compressed, measured end
    to end (``measured_alone``): taken as they are, nothing carried back for ``r``. ``back_tick``
    ticks per layer. ``parked()``: a block during which what ``options`` reads may leave memory
    (the layers' sweep, after the first gradients)."""
    import time

    import torch

    t0 = time.perf_counter()
    layers = len(ref.model.layers)
    by_layer: dict[int, list[str]] = {}
    for n in compressed:
        by_layer.setdefault(layer_of(n), []).append(n)
    dev, dtype = ref.device, ref.dtype
    config = ref.model.config
    measured = measured or {}
    sizes: dict[int, list[int]] = {}  # record -> its questions' option counts
    for r in range(len(records)):  # every carried option's gradient at the last layer's output
        if r in measured:
            continue
        h = torch.from_numpy(outputs.entering(layers, r)).to(device=dev, dtype=dtype).requires_grad_(True)
        with torch.enable_grad(), one_thread():
            questions = options(r, ref.model.norm(h[None]))
            sizes[r] = [len(q) for q in questions]
            carried = [q[o] for q in questions for o in range(len(q) - 1)]  # each question's last: ``Answers``
            out = outputs.mapped(_grads_path(outputs, r, layers - 1).name, (len(carried),) + tuple(h.shape))
            for o, p in enumerate(carried):
                # one backward an option: batched (``is_grads_batched``), the head's slices of the rows
                # fill a zero tensor of the copies' size each, 10x slower at 130 options (measured)
                out[o] = torch.autograd.grad(p, h, retain_graph=o + 1 < len(carried))[0].cpu().numpy()
            out.flush()
            del out

    estimates = {i: LayerEstimate() for i in range(layers) if i in by_layer}
    sweep = Sweep(estimates, head_s=time.perf_counter() - t0)
    carried = [r for r in range(len(records)) if r not in measured]
    deq = Dequantizer(ref.source, infos, scheme, compressed, scaled)

    def entering(i: int, r: int):
        kept = outputs.entering(i, r)
        return (ref.embed(records[r]) if kept is None else torch.from_numpy(kept).to(device=dev, dtype=dtype))[None]

    with parked():  # the head is not called again in the sweep
        for i in reversed(range(layers)):
            kwargs_of = {r: calls.by_record[r][layer_types[i]] for r in range(len(records))}
            changes: dict[int, list[float]] = {r: [float(v) for v in measured[r][i]] for r in measured} if i in by_layer else {}
            t0 = time.perf_counter()
            if i in by_layer:  # compressed: its own output first, so that its two forms are never held at once
                deq.layers = {i}
                with ref.layer_loaded(i, deq) as squeezed:
                    for r in range(len(records)):
                        # the pass's own output of the layer is what the layer gives run alone (bit for bit: tested)
                        want = torch.from_numpy(outputs.entering(i + 1, r)).to(device=dev, dtype=dtype)[None]
                        d = _own_error(estimates[i], squeezed, entering(i, r), want, kwargs_of[r])
                        if r in carried:
                            outputs.save(_diff_path(outputs, r, i).name, d.cpu().numpy())
            t1 = time.perf_counter()
            if carried and (i in by_layer or i > 0):
                with ref.layer_loaded(i) as layer:
                    for r in carried:
                        changes[r] = _carried(layer, config, entering(i, r), kwargs_of[r], outputs, r, i, sizes[r], estimates.get(i))
            if i in by_layer:
                for r in range(len(records)):  # in record order, as the oracle's figures are
                    estimates[i].dp.extend(changes[r])
            sweep.own_s += t1 - t0
            sweep.carry_s += time.perf_counter() - t1
            back_tick()
    return sweep


def _diff_path(outputs: LayerOutputs, record: int, layer: int) -> Path:
    return outputs.path / f"diff-{layer}-{record}.npy"


def _carried(layer, config, x, kwargs: dict, outputs: LayerOutputs, r: int, i: int, sizes: list[int],
             estimate: "LayerEstimate | None") -> list[float]:
    """Record ``r`` at layer ``i`` (loaded uncompressed, ``x`` its input): each option's first-order
    change from its gradient at the layer's output and the layer's own error (when it is
    compressed: ``estimate``), then the gradients carried back to the layer's input (none at 0)."""
    import torch

    dev, dtype = x.device, x.dtype
    d = torch.from_numpy(np.load(_diff_path(outputs, r, i))).to(device=dev, dtype=dtype) if estimate is not None else None
    g_all = np.load(_grads_path(outputs, r, i), mmap_mode="r")
    back = outputs.mapped(_grads_path(outputs, r, i - 1).name, g_all.shape) if i > 0 else None
    answers = Answers(sizes)
    with carrying_back(layer, config, x, kwargs) if back is not None and len(g_all) else nullcontext() as carry:
        for o in range(len(g_all)):
            g = torch.from_numpy(np.array(g_all[o])).to(device=dev, dtype=dtype)  # a copy: the file is read-only
            if d is not None:
                # summed by numpy in fp64 (pairwise, one thread): the same bits at any torch thread count
                answers.add(o, (g * d).double().cpu().numpy())
            if carry is not None:  # the option's gradient carried back through the layer
                back[o] = carry(g[None])[0].cpu().numpy()
    del g_all
    _grads_path(outputs, r, i).unlink()
    if back is not None:
        back.flush()
        del back
    if d is None:
        return []
    _diff_path(outputs, r, i).unlink()
    changes = answers.changes()
    estimate.fisher = max(estimate.fisher or 0.0, answers.fisher)
    return changes


def _own_error(e: LayerEstimate, squeezed, x, want, kwargs):
    """The layer run on the pass's input with its linears compressed (``squeezed``): its own error
    against the pass's output ``want`` (kept in ``e``) and the difference ``d`` ([T, H]) the
    options' gradients meet."""
    import torch

    with torch.no_grad():
        got = squeezed(x, **kwargs)
        got = got[0] if isinstance(got, tuple) else got
    d = (got - want)[0]
    top = max(float(want.abs().max()), 1e-30)
    e.rel_max_abs_d = max(e.rel_max_abs_d, float(d.abs().max()) / top)
    e.rel_rms_d = max(e.rel_rms_d, float(np.sqrt(np.mean(np.square(d.double().cpu().numpy())))) / top)
    return d


class Answers:
    """One record's first-order changes at a layer, every option in order, from the gradients of all
    but each question's last option: a question's probabilities sum to one, so the last one's
    gradient is minus the others' sum, and so is its ``g * d`` (one option fewer carried back a
    question: 5 of 16 at the slice's 4 requests). ``fisher``: the worst option's
    ``sum((g * d)**2)``."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.owner = [q for q, n in enumerate(sizes) for _ in range(n - 1)]  # carried option -> its question
        self.dp: list[float] = []
        self.sums: dict[int, np.ndarray] = {}
        self.fisher = 0.0

    def add(self, k: int, gd: np.ndarray) -> None:
        """Carried option ``k``'s ``g * d`` ([T, H], fp64), in order."""
        self.dp.append(float(np.sum(gd)))
        self.fisher = max(self.fisher, float(np.sum(np.square(gd))))
        q = self.owner[k]
        self.sums[q] = gd.copy() if q not in self.sums else self.sums[q] + gd

    def changes(self) -> list[float]:
        """Every option's change, in order (a question of one option: 0, its probability is 1)."""
        out, k = [], 0
        for q, n in enumerate(self.sizes):
            if not n:
                continue
            out.extend(self.dp[k:k + n - 1])
            k += n - 1
            others = self.sums.get(q)
            if others is None:
                out.append(0.0)
                continue
            out.append(float(np.sum(-others)))
            self.fisher = max(self.fisher, float(np.sum(np.square(others))))
        return out
