"""Write the test LoRA adapter for the default model (SmolLM2-135M-Instruct), in PEFT's format.

    python -m tests.data.lora.make_adapter [--out DIR]

PEFT's on-disk format is two files: ``adapter_config.json`` (``LoraConfig`` fields) and
``adapter_model.safetensors`` with, per adapted linear layer W [out, in],
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]; the
adapted layer computes W x + (lora_alpha / r) * B A x. vLLM's ``LoRAModel.from_local_checkpoint``
and PEFT's ``PeftModel.from_pretrained`` read exactly these files, so no ``peft`` install is
needed to write them.

The weights are seeded Gaussians (no training): A ~ N(0, 1/in), and B scaled so that every
update ||(alpha/r) B A||_F is ``RELATIVE_NORM`` of its base weight's ||W||_F. That is large
enough to change the model's greedy continuations within a few dozen tokens while its text
stays fluent (tests/e2e/test_lora.py asserts the change), and small enough that the adapter
is a perturbation of the base model, as a fine-tune is. Rank 4 on the attention's q and v
projections of all 30 layers: 230,400 float32 parameters (0.9 MB).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
RANK = 4
ALPHA = 8
TARGET_MODULES = ["q_proj", "v_proj"]
RELATIVE_NORM = 0.15
SEED = 0
PREFIX = "base_model.model."


def adapter_config(base_model: str) -> dict:
    """The ``LoraConfig`` fields PEFT writes (vLLM's ``PEFTHelper`` reads r, lora_alpha,
    target_modules, bias, modules_to_save, use_rslora, use_dora)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": TARGET_MODULES,
            "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True}


def adapter_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """lora_A / lora_B of every target module, seeded, scaled against the base weights."""
    gen = torch.Generator().manual_seed(SEED)
    scaling = ALPHA / RANK
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = sorted((n for n in f.keys()
                        if n.endswith(".weight") and n.rsplit(".", 2)[-2] in TARGET_MODULES),
                       key=lambda n: (int(n.split(".")[2]), n))
        for name in names:
            w = f.get_tensor(name).to(torch.float32)  # [out, in]
            a = torch.randn(RANK, w.shape[1], generator=gen) / w.shape[1] ** 0.5
            b = torch.randn(w.shape[0], RANK, generator=gen)
            b *= RELATIVE_NORM * w.norm() / (scaling * (b @ a).norm())
            module = name.removesuffix(".weight")
            out[f"{PREFIX}{module}.lora_A.weight"] = a.contiguous()
            out[f"{PREFIX}{module}.lora_B.weight"] = b.contiguous()
    if not out:
        raise SystemExit(f"no {TARGET_MODULES} weights in {model_dir}/model.safetensors")
    return out


def write_adapter(out: Path, model_dir: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(model_dir), str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(adapter_config("SmolLM2-135M-Instruct"), indent=2) + "\n")
    return out


def main() -> None:
    from vllm_clover.default_model import ensure_default_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "smollm2-random-r4",
                        help="adapter directory (default: the one the tests load)")
    args = parser.parse_args()
    print(write_adapter(args.out, ensure_default_model(verbose=False)))


if __name__ == "__main__":
    main()
