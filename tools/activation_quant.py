"""What llama.cpp's activation quantization is worth on the fixture GGUFs (docs/gguf.md, "Activation quantization").

llama.cpp's CPU matmuls against a quantized weight first round the activation row to the weight type's
`vec_dot_type` (Q8_0 blocks of 32 for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL, Q8_K blocks of 256 for k- and i-quants).
strata keeps activations in float by default. This tool runs strata with that rounding emulated in `Ops.linear`,
and in strata's own `--activations q8` mode (runs of 32 for every type, as llama.cpp's CUDA matmuls round), and
reports, per fixture file: KL(strata ‖ each) over the 64 prompt positions, and KL(llama.cpp ‖ each) at the
positions where llama.cpp's and transformers' QSA selection rules agree (q < budget + ratio - 1, or
q mod ratio == ratio - 2; MANIFEST.md "QSA divergence").

    .venv/bin/python tools/activation_quant.py --fixtures ../shared/fixtures/qwen4exp-tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.model.ops import Ops, linear_ref  # noqa: E402
from strata.runtime.engine import Engine, load_weights  # noqa: E402

Q8_0_FOR = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml quantize_row_q8_0 then dequantize: blocks of 32, d = amax / 127 (stored fp16), q = round(x / d)."""
    b = x.float().reshape(-1, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, 1)), 0)
    return (q * d).reshape(x.shape).to(x.dtype)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """ggml quantize_row_q8_K then dequantize: blocks of 256, iscale = -127 / max (the signed value of largest
    magnitude), q = min(127, round(iscale * x)), d = 1 / iscale (float)."""
    b = x.float().reshape(-1, 256)
    idx = b.abs().argmax(-1, keepdim=True)
    mx = b.gather(-1, idx)
    iscale = torch.where(mx != 0, -127 / torch.where(mx != 0, mx, 1), 0)
    q = torch.clamp(torch.round(iscale * b), max=127)
    d = torch.where(iscale != 0, 1 / torch.where(iscale != 0, iscale, 1), 0)
    return (q * d).reshape(x.shape).to(x.dtype)


def rounding_linear(x, w, bias=None):  # noqa: ANN001, ANN201 - Ops.linear's signature
    kind = w.kind
    if kind in ("F32", "BF16", "F16") or x.shape[-1] % 32:
        return linear_ref(x, w, bias)
    if kind in Q8_0_FOR:
        return linear_ref(round_q8_0(x), w, bias)
    if x.shape[-1] % 256 == 0:
        return linear_ref(round_q8_k(x), w, bias)
    return linear_ref(x, w, bias)


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    p = torch.log_softmax(torch.from_numpy(p_logits).double(), -1)
    q = torch.log_softmax(torch.from_numpy(q_logits).double(), -1)
    return (p.exp() * (p - q)).sum(-1).numpy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fx = Path(args.fixtures)
    ids = json.loads((fx / "prompt.json").read_text())["ids"]
    rows = []
    for path in sorted(fx.glob("tiny-*.gguf")):
        if path.name == "tiny-f32.gguf":
            continue
        w = load_weights(path)
        cfg = w.cfg
        plain = Engine(w).prefill(ids, Engine(w).new_state(), all_logits=True).numpy()
        act = Engine(w, ops=Ops(linear=rounding_linear))
        rounded = act.prefill(ids, act.new_state(), all_logits=True).numpy()
        mode = Engine(w, activations="q8")  # strata's own mode: runs of 32 with an fp32 scale for every type
        q8 = mode.prefill(ids, mode.new_state(), all_logits=True).numpy()
        llama = np.load(fx / f"{path.stem}.logits.npy")
        c, width = cfg.indexer_compress_ratio, cfg.selection_width
        agree = np.array([q < width or q % c == c - 2 for q in range(len(ids))])
        rows.append({"file": path.name, "kl_strata_vs_rounded": float(kl(plain, rounded).mean()),
                     "max_abs_dlogit": float(np.abs(plain - rounded).max()),
                     "agreeing_positions": int(agree.sum()),
                     "kl_llama_vs_strata": float(kl(llama, plain)[agree].mean()),
                     "kl_llama_vs_strata_rounded": float(kl(llama, rounded)[agree].mean()),
                     "kl_strata_vs_q8_mode": float(kl(plain, q8).mean()),
                     "max_abs_dlogit_q8_mode": float(np.abs(plain - q8).max()),
                     "kl_llama_vs_q8_mode": float(kl(llama, q8)[agree].mean())})
        r = rows[-1]
        print(f"{path.name:<20} {r['kl_strata_vs_rounded']:.2e} {r['max_abs_dlogit']:.3f} "
              f"{r['kl_llama_vs_strata']:.2e} {r['kl_llama_vs_strata_rounded']:.2e} | --activations q8: "
              f"{r['kl_strata_vs_q8_mode']:.2e} {r['max_abs_dlogit_q8_mode']:.3f} {r['kl_llama_vs_q8_mode']:.2e}",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
