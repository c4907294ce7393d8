"""One command for a machine with GPUs: every check one device can run, then the multi-rank matrices.

    python scripts/device_smoke.py [--out smoke.json] [--skip-matrix]

1. References on the device: each fixture forward and backward on cuda:0 in fp32 and bf16; the bf16 run's
   error against fp32 (what the reduced-precision rule scales), and the fp32 device run against the CPU.
2. Attention: paracheck's CPU attention op (the one gloo ring runs use) against the device's own backends
   (SDPA math / flash / efficient / cudnn, and diffusers' ring-capable ones where installed), forward, LSE.
3. With 2 or more GPUs: `paracheck run --backend nccl --nproc 2` (and 4 with 4 GPUs) at bf16 with controls.
Writes a JSON summary; exits 0 when everything ran and passed, 1 otherwise, 2 without a CUDA device.
Sized for about five minutes on one GPU (the fixtures are tiny).
"""

import argparse
import json
import subprocess
import sys
import time


def references(device) -> list[dict]:
    import torch

    from paracheck.adapters.diffusers import reference
    from paracheck.domain.case import call_factory
    from paracheck.adapters.diffusers.fixtures_index import FIXTURES

    rows = []
    for name, factory in FIXTURES.items():
        cls, init, inputs = call_factory(factory)
        torch.manual_seed(0)
        cpu = cls(**init).eval()
        out_cpu = reference.forward(cpu, reference.place(inputs, torch.device("cpu"), torch.float32))
        row = {"model": name}
        for dtype in (torch.float32, torch.bfloat16):
            model = cls(**init).eval()
            model.load_state_dict(cpu.state_dict())
            model = model.to(device, dtype)
            out = reference.forward(model, reference.place(inputs, device, dtype)).float().cpu()
            out.sum().backward()
            row[f"{dtype}".split(".")[-1]] = float((out - out_cpu).abs().max())
        rows.append(row)
    return rows


def attention(device) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from paracheck.adapters.diffusers.attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 4, 64, generator=g) for _ in range(3))
    ref, lse = attend(q.double(), k.double(), v.double())
    rows = []
    for kernel in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.CUDNN_ATTENTION):
        for dtype in (torch.float32, torch.bfloat16):
            try:
                with sdpa_kernel(kernel):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        *(t.to(device, dtype).transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
                rows.append({"backend": kernel.name, "dtype": str(dtype), "forward_max_abs":
                             float((out.double().cpu() - ref).abs().max())})
            except RuntimeError as exc:  # the kernel is not available for this dtype or device
                rows.append({"backend": kernel.name, "dtype": str(dtype), "unavailable": str(exc)[:200]})
    rows.append({"backend": "paracheck_cpu_lse", "lse_finite": bool(torch.isfinite(lse).all())})
    return rows


def matrix(gpus: int) -> list[dict]:
    rows = []
    for nproc in [n for n in (2, 4) if n <= gpus]:
        cmd = [sys.executable, "-m", "paracheck", "run", "--backend", "nccl", "--nproc", str(nproc), "--dtype", "bf16",
               "--controls", "--variants", "base", "--quiet", "--report-json", f"smoke-nccl-{nproc}.json"]
        started = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows.append({"nproc": nproc, "exit_code": proc.returncode, "seconds": round(time.time() - started, 1),
                     "summary": proc.stdout.strip().splitlines()[-1:] if proc.stdout else []})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="smoke.json")
    parser.add_argument("--skip-matrix", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("device_smoke: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda:0")
    summary = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
               "torch": torch.__version__, "references": references(device), "attention": attention(device)}
    if not args.skip_matrix:
        summary["matrix"] = matrix(summary["gpus"])
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps(summary, indent=1))
    failed = any(r["exit_code"] != 0 for r in summary.get("matrix", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
