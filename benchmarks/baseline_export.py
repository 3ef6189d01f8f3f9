"""The straightforward export, as the baseline of `make bench`: exactly the published recipe's
steps with no optimisation. fp32 master weights are built and kept, each bucket is traced with
torch.export and decomposed, one converter takes the four programs, one asset is saved.

    python benchmarks/baseline_export.py SOURCE_DIR PINS OUT.aimodel
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from pathlib import Path

warnings.simplefilter("ignore")


def main(source: Path, pins_path: Path, out: Path) -> None:
    import coreai_torch
    import torch
    from coreai_torch import TorchConverter
    from safetensors.torch import load_file

    from clef_flash.sources.author import load_author_module
    from clef_flash.head.contract import BUCKETS, INPUT_ORDER, function_name
    from clef_flash.head.tracing import example_inputs
    from clef_flash.head.graph import ClefHeadGraph
    from clef_flash.sources.pins import load_pins

    t0 = time.perf_counter()
    pins = load_pins(pins_path)
    module = load_author_module(source / "joint_schema_model.py", pins.files["joint_schema_model.py"])
    config = json.loads((source / "joint_head_config.json").read_text())
    head = module.JointSchemaHead(**config)  # fp32 master weights, randomly initialised first
    head.load_state_dict({k: v.float() for k, v in load_file(source / "joint_head.safetensors").items()}, strict=True)
    head.eval()
    graph = ClefHeadGraph(copy.deepcopy(head).half()).eval()  # fp16 copy; the fp32 master is kept
    t_build = time.perf_counter() - t0

    t0 = time.perf_counter()
    converter = TorchConverter()
    for bucket in BUCKETS:
        ep = torch.export.export(graph, example_inputs(bucket, config["hidden_size"], 16, 128))
        ep = ep.run_decompositions(coreai_torch.get_decomp_table())
        converter.add_exported_program(ep, input_names=list(INPUT_ORDER), output_names=["logits"],
                                       entrypoint_name=function_name(bucket))
    program = converter.to_coreai()
    t_export = time.perf_counter() - t0
    t0 = time.perf_counter()
    program.save_asset(out)
    t_save = time.perf_counter() - t0
    print(json.dumps({"build": t_build, "export": t_export, "save": t_save, "master_params": sum(p.numel() for p in head.parameters())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
