"""The decoder's exported program from one traced layer of each kind, copied for every layer.

How it works: docs/modules.md."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .contract import LM


class StitchError(RuntimeError):
    """The traced program is not of the shape ``stitch`` copies; trace every layer instead."""


def layer_names(module, i: int) -> list[str]:
    prefix = f"{LM}layers.{i}."
    return sorted(n for n in [*module.w, *module._buffer, *module._codes] if n.startswith(prefix))


def group_key(module, i: int) -> tuple:
    """What makes a layer's nodes differ from another's: its kind, which matrices are compressed,
    and the exponents of what it reads (a ``mul`` by 2**-k where k != 0)."""
    prefix = f"{LM}layers.{i}."
    return (module.cfg.layer_types[i],
            tuple((n[len(prefix):], n in module._codes, module.exponents.get(n, 0)) for n in layer_names(module, i)))


def templates(module) -> dict[int, int]:
    """Each layer -> the first layer of its group (the one traced)."""
    first: dict[tuple, int] = {}
    return {i: first.setdefault(group_key(module, i), i) for i in range(len(module.cfg.layer_types))}


def state_index(cfg, i: int) -> int:
    """Layer i's slot in its kind's states (what ``DecoderChunk`` passes it as ``n``)."""
    return (cfg.full_layers if cfg.layer_types[i] == "full_attention" else cfg.linear_layers).index(i)


_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)$")


def _block_of(node) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for path, _ in stack.values():
        m = _BLOCK.search(path)
        if m:
            found = int(m.group(1))
    return found


@dataclass
class _Versions:
    """The nodes that are versions of each state (its placeholder, then each ``where`` that writes it)."""

    of: dict  # node -> state placeholder name
    writes: dict  # ``where`` node -> state placeholder name


def _state_versions(ep) -> _Versions:
    from torch.export.graph_signature import OutputKind

    nodes = {n.name: n for n in ep.graph.nodes}
    out = next(n for n in ep.graph.nodes if n.op == "output")
    of, writes = {}, {}
    for spec, arg in zip(ep.graph_signature.output_specs, out.args[0]):
        if spec.kind != OutputKind.USER_INPUT_MUTATION:
            continue
        state = spec.target
        node = arg
        while node.op != "placeholder":
            if node.target.__name__ != "where.self" or len(node.args) != 3:
                raise StitchError(f"state {state} is written by {node.target} (expected where)")
            of[node], writes[node] = state, state
            node = node.args[2]
        if node is not nodes[state]:
            raise StitchError(f"state {state}'s versions do not start at its input")
        of[node] = state
    return _Versions(of, writes)


def stitch(tep, module):
    """The full program from ``tep``, the trace of ``module`` with ``module.only`` = its templates'
    layers (``templates``). Raises ``StitchError`` where the trace is not what the copy assumes."""
    import torch
    from torch.export import ExportedProgram
    from torch.export.graph_signature import ExportGraphSignature, OutputKind, OutputSpec, TensorArgument

    cfg = module.cfg
    tmpl = templates(module)
    traced = sorted(set(tmpl.values()))
    sig, graph = tep.graph_signature, tep.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    spec_of = {s.arg.name: s for s in sig.input_specs}
    versions = _state_versions(tep)
    blocks, prologue, epilogue, block_of_node = _split_blocks(graph, traced)
    x_in, x_out = _residuals(blocks, traced, set(prologue), versions, (1, module.ch.chunk, cfg.hidden_size))
    slot_args = _slot_args(cfg, blocks, traced, versions, block_of_node)
    weight_of, owner = _weights_of(tep, module)
    extra = _extra_constants(module, tmpl, blocks, weight_of, owner, spec_of)

    new = torch.fx.Graph()
    env, specs, node_of_weight = _copy_inputs(new, placeholders, spec_of, weight_of, extra)
    for n in prologue:
        env[n] = new.node_copy(n, lambda a: env[a])
    by_name = {p.name: p for p in placeholders}
    state = {s: env[by_name[s]] for s in set(versions.of.values())}
    x = env[x_in[traced[0]]]
    for i in range(len(cfg.layer_types)):
        x = _copy_layer(new, i, tmpl[i], cfg, blocks, x, x_in, x_out, state, versions, env, owner, weight_of,
                        node_of_weight, slot_args)
    last = x_out[traced[-1]]
    for n in epilogue:
        env[n] = new.node_copy(n, lambda a: x if a is last else state[versions.of[a]] if a in versions.of else env[a])
    out = next(n for n in graph.nodes if n.op == "output")
    outs, out_specs = [], []
    for spec, a in zip(sig.output_specs, out.args[0]):
        v = state[spec.target] if spec.kind == OutputKind.USER_INPUT_MUTATION else (x if a is last else env[a])
        outs.append(v)
        out_specs.append(OutputSpec(kind=spec.kind, arg=TensorArgument(name=v.name), target=spec.target))
    new.output(tuple(outs))
    constants = dict(tep.constants)
    for k, w in enumerate(sorted(extra)):
        constants[f"stitched_{k}"] = module.w[w]
    gm = torch.fx.GraphModule(tep.graph_module, new)
    calls = [e for e in tep.module_call_graph if e.fqn == ""]
    if calls and calls[0].signature is not None:
        s0 = calls[0].signature
        names = [o.arg.name for o in out_specs if o.kind == OutputKind.USER_OUTPUT]
        s0.outputs = [TensorArgument(name=nm) for nm in names]
    return ExportedProgram(root=gm, graph=new, graph_signature=ExportGraphSignature(specs, out_specs),
                           state_dict=tep.state_dict, range_constraints=tep.range_constraints, module_call_graph=calls,
                           constants=constants, verifiers=[tep.verifier])


def _split_blocks(graph, traced: list[int]):
    """The nodes of each traced layer, and what comes before (prologue) and after (epilogue) them."""
    blocks: dict[int, list] = {t: [] for t in traced}
    prologue, epilogue, block_of_node = [], [], {}
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        b = _block_of(n)
        if b is None:
            (epilogue if any(blocks.values()) else prologue).append(n)
        elif b not in blocks:
            raise StitchError(f"node {n.name} is tagged with layer {b}, which was not traced")
        elif epilogue or any(blocks[u] for u in traced if u > b):
            raise StitchError("the traced layers' nodes are not in one run each, in order")
        else:
            blocks[b].append(n)
        block_of_node[n] = b
    if not all(blocks.values()):
        raise StitchError("a traced layer has no nodes")
    return blocks, prologue, epilogue, block_of_node


def _shape_of(n):
    import torch

    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _residuals(blocks, traced: list[int], before: set, versions, hidden: tuple[int, ...]):
    """Each block's residual input and output: the one [1, S, H] value it takes from, and gives to,
    the rest (its state versions aside)."""
    x_in, x_out = {}, {}
    for t in traced:
        mine = set(blocks[t])
        outside = {a for n in blocks[t] for a in n.all_input_nodes if a not in mine and a.op != "placeholder" and a not in versions.of}
        xs = [a for a in outside if _shape_of(a) == hidden]
        if len(xs) != 1:
            raise StitchError(f"layer {t} reads {len(xs)} residual values")
        if any(a not in before and a is not xs[0] for a in outside):
            raise StitchError(f"layer {t} reads another layer's values beyond the residual stream")
        x_in[t] = xs[0]
        used_later = [n for n in blocks[t] if n not in versions.of and any(u not in mine for u in n.users)]
        if len(used_later) != 1 or _shape_of(used_later[0]) != hidden:
            raise StitchError(f"layer {t} gives {len(used_later)} values to the rest")
        x_out[t] = used_later[0]
    for a, b in zip(traced, traced[1:]):
        if x_in[b] is not x_out[a]:
            raise StitchError(f"layer {b} does not continue from layer {a}")
    return x_in, x_out


def _slot_args(cfg, blocks, traced: list[int], versions, block_of_node) -> dict:
    """The state slot in each block: ``select(state, 0, n)`` reads, ``where(eq(slots, n), new, state)``
    writes; node -> the position of its slot argument."""
    slot_args: dict = {}
    for t in traced:
        n_t = state_index(cfg, t)
        for n in blocks[t]:
            for a in n.all_input_nodes:
                if a not in versions.of:
                    continue
                if n in versions.writes and n.args[2] is a and a not in n.args[:2]:
                    eq = n.args[0]
                    if getattr(eq.target, "__name__", "") != "eq.Scalar" or eq.args[1] != n_t or block_of_node.get(eq) != t:
                        raise StitchError(f"layer {t} writes a state other than through eq(slots, {n_t})")
                    slot_args[eq] = 1
                elif getattr(n.target, "__name__", "") == "select.int" and n.args[0] is a and n.args[1:] == (0, n_t):
                    slot_args[n] = 2
                else:
                    raise StitchError(f"layer {t} reads a state through {n.target}")
    return slot_args


def _weights_of(tep, module):
    """Which weight each buffer and 1-D constant placeholder holds, and the layer it belongs to."""
    import torch
    from torch.export.graph_signature import InputKind

    weight_of: dict[str, str] = {}
    buffer_weight = {b: n for n, b in module._buffer.items()}
    for n, (q, s) in module._codes.items():
        buffer_weight[q], buffer_weight[s] = f"{n}#codes", f"{n}#scales"
    by_ptr = {t.data_ptr(): n for n, t in module.w.items() if t.numel()}
    for spec in tep.graph_signature.input_specs:
        if spec.kind == InputKind.BUFFER and spec.target in buffer_weight:
            weight_of[spec.arg.name] = buffer_weight[spec.target]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            c = tep.constants[spec.target]
            name = by_ptr.get(c.data_ptr()) if isinstance(c, torch.Tensor) and c.numel() else None
            if name is not None and layer_of_name(name) is not None:
                if tuple(module.w[name].shape) != tuple(c.shape):
                    raise StitchError(f"constant {spec.target} is part of {name}")
                weight_of[spec.arg.name] = name
    owner = {p: layer_of_name(w.split("#")[0]) for p, w in weight_of.items()}  # placeholder -> its weight's layer
    return weight_of, owner


def _swap(w: str, t: int, i: int) -> str:
    return w.replace(f"{LM}layers.{t}.", f"{LM}layers.{i}.", 1)


def _extra_constants(module, tmpl, blocks, weight_of, owner, spec_of) -> dict[str, object]:
    """The 1-D weights of the layers not traced, constants of their own: weight name -> the template's
    placeholder it stands in for."""
    from torch.export.graph_signature import InputKind

    extra: dict[str, object] = {}
    for i, t in tmpl.items():
        for n in blocks[t]:
            for a in n.all_input_nodes:
                if a.op != "placeholder" or a.name not in weight_of:
                    continue
                if owner[a.name] != t:
                    raise StitchError(f"layer {t} reads {weight_of[a.name]}, another layer's weight")
                if i != t and spec_of[a.name].kind == InputKind.CONSTANT_TENSOR:
                    extra.setdefault(_swap(weight_of[a.name], t, i), a)
    for w in extra:
        if w not in module.w:
            raise StitchError(f"no {w} for the copy of its layer")
    return extra


def _copy_inputs(new, placeholders, spec_of, weight_of, extra):
    """The program's inputs copied, the new constants placed before the user inputs (as export orders
    them): (old node -> new node, the input specs, weight name -> its placeholder)."""
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    env: dict = {}
    specs = []
    node_of_weight: dict[str, object] = {}
    pending = bool(extra)
    for p in placeholders:
        spec = spec_of[p.name]
        if spec.kind == InputKind.USER_INPUT and pending:
            pending = False
            for k, (w, stand_in) in enumerate(sorted(extra.items())):
                node = new.placeholder(f"c_stitched_{k}")
                node.meta = dict(stand_in.meta)
                specs.append(InputSpec(kind=InputKind.CONSTANT_TENSOR, arg=TensorArgument(name=node.name), target=f"stitched_{k}"))
                node_of_weight[w] = node
        node = new.node_copy(p)
        env[p] = node
        specs.append(InputSpec(kind=spec.kind, arg=TensorArgument(name=node.name), target=spec.target,
                               persistent=spec.persistent))
        if p.name in weight_of:
            node_of_weight[weight_of[p.name]] = node
    return env, specs, node_of_weight


def _copy_layer(new, i: int, t: int, cfg, blocks, x, x_in, x_out, state, versions, env, owner, weight_of,
                node_of_weight, slot_args):
    """Layer ``i`` as a copy of its template ``t``'s nodes: its own weights, state slot, the residual
    ``x`` and the states so far (``state`` updated); returns its residual output."""
    n_i = state_index(cfg, i)
    local: dict = {}

    def arg(a):
        if a in local:
            return local[a]
        if a is x_in[t]:
            return x
        if a in versions.of:
            return state[versions.of[a]]
        if a.op == "placeholder" and owner.get(a.name) == t:
            mine = _swap(weight_of[a.name], t, i)
            if mine not in node_of_weight:
                raise StitchError(f"layer {i} has no {mine} for its copy of layer {t}")
            return node_of_weight[mine]
        return env[a]

    for n in blocks[t]:
        c = new.node_copy(n, arg)
        if n in slot_args:
            args = list(c.args)
            args[slot_args[n]] = n_i
            c.args = tuple(args)
        local[n] = c
        if n in versions.writes:
            state[versions.writes[n]] = c
    return local[x_out[t]]


def layer_of_name(name: str) -> int | None:
    m = re.match(re.escape(f"{LM}layers.") + r"(\d+)\.", name)
    return int(m.group(1)) if m else None
