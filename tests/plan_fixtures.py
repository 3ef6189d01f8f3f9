"""Tiny releases edited into the cases a fast weight plan must survive (issue 47's red fixtures),
each a copy of a clef-finetune ``make-tiny`` release with a few tensors changed and pinned again.

- ``head_ignores``: the last layer writes the same value into every hidden dimension (every row
  of its MLP's ``down_proj`` is one vector, and of its attention's ``o_proj``; with an outlier in each block of 32 so int8 rounds the
  rest coarsely). The final norm's weight is uniform, so the head's first LayerNorm removes that
  direction exactly: the layer's own error is the largest of all, and its effect on the answers is
  only its attention's.
- ``saturated``: the head's option scorer scaled up so that answers sit near p = 1, where the
  answers' gradients vanish (the first-order estimate sees almost nothing)."""

from __future__ import annotations

import shutil
from pathlib import Path

LM = "model.language_model."
SATURATING = 400.0  # the head's residual scorer's last weights times this: most answers above p = 0.99


def edited_release(src: Path, dst: Path, edit, head_edit=None) -> Path:
    """``src`` copied to ``dst`` with ``edit(tensors)`` applied to model.safetensors (and
    ``head_edit`` to joint_head.safetensors), then pinned again (``clef-export pin``)."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from clef_flash.cli import app

    shutil.copytree(src, dst)
    (dst / "pins.json").unlink(missing_ok=True)
    for name, fn in (("model.safetensors", edit), ("joint_head.safetensors", head_edit)):
        if fn is None:
            continue
        tensors = load_file(dst / name)
        fn(tensors)
        save_file(tensors, dst / name, metadata={"format": "pt"})
    res = CliRunner().invoke(app, ["pin", str(dst), "--name", dst.name.replace("-", "_"), "--overwrite"])
    assert res.exit_code == 0, res.output
    return dst


def head_ignores(tensors) -> None:
    import torch

    last = max(int(k.split(".")[3]) for k in tensors if k.startswith(f"{LM}layers."))
    down = tensors[f"{LM}layers.{last}.mlp.down_proj.weight"]
    row = down[0].float().clone()
    row[0::32] = 1.0  # one outlier a block: int8's step becomes 1/127, coarse for the other weights
    tensors[f"{LM}layers.{last}.mlp.down_proj.weight"] = row.expand_as(down).to(down.dtype).contiguous()
    o = tensors[f"{LM}layers.{last}.self_attn.o_proj.weight"]  # the attention's writes made uniform too
    tensors[f"{LM}layers.{last}.self_attn.o_proj.weight"] = o[0].expand_as(o).contiguous()
    tensors[f"{LM}norm.weight"] = torch.zeros_like(tensors[f"{LM}norm.weight"])  # uniform (1 + w)


def saturated(head) -> None:
    import torch

    w = head["residual_scorer.3.weight"]
    head["residual_scorer.3.weight"] = (w.float() * SATURATING).to(w.dtype)
