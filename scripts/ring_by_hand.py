"""By-hand check of diffusers' own ring attention on gloo, through paracheck's CPU LSE backend.

Run with as many ranks as the layout needs, e.g.
    GLOO_SOCKET_IFNAME=lo python -m torch.distributed.run --nproc_per_node=4 scripts/ring_by_hand.py \
        --model flux --ring 4 --cases plain,stale-kv-backward,drop-ring-merge,fixed
Prints, per case, the worst forward and gradient (summed over the CP group) error over all ranks.
Cases: plain; a planted fault (stale-kv-backward, drop-ring-merge); fixed (reversed_ring_rotation).
Models are the bundled fixtures with 4 heads; `--text-mask pad` pads QwenImage's last three text tokens.
"""

import argparse
import copy
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from paracheck.adapters.diffusers.attention import cpu_lse_attention  # noqa: E402
from tests.specs import reversed_ring_rotation  # noqa: E402  (test-only: the fix applied by hand)
from paracheck.adapters.diffusers.library import cpu_device_count  # noqa: E402


def fixtures():
    # This worktree's fixtures, not whichever copy an editable install maps `paracheck.fixtures` to.
    spec = importlib.util.spec_from_file_location("wt_fixtures", os.path.join(ROOT, "fixtures", "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name, text_mask):
    cls, init, inputs = getattr(fixtures(), name)()
    init = dict(init, num_attention_heads=4)
    if text_mask == "none":
        inputs = dict(inputs, encoder_hidden_states_mask=None)
    elif text_mask == "pad":
        mask = torch.ones(1, inputs["encoder_hidden_states"].shape[1], dtype=torch.long)
        mask[:, -3:] = 0  # the last three text tokens are padding
        inputs = dict(inputs, encoder_hidden_states_mask=mask)
    return cls, init, inputs


def run(model, inputs, weights):
    out = model(**inputs, return_dict=False)[0]
    (out * weights).sum().backward()
    return out.detach()


def case(name, reference, ref_out, inputs, weights, cp, dtype):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    fault = name if name in ("stale-kv-backward", "drop-ring-merge") else None
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    with cpu_lse_attention(fault=fault), cpu_device_count():
        model.enable_parallelism(config=ParallelConfig(context_parallel_config=ContextParallelConfig(**cp)))
        fix = reversed_ring_rotation() if name == "fixed" else _nothing()
        with fix:
            out = run(model, inputs, weights)
    fwd = (out.double() - ref_out.double()).abs().max()
    group = model._parallel_config.context_parallel_config._flattened_mesh.get_group()
    ref_params = dict(reference.named_parameters())
    worst, worst_name, scale = torch.zeros((), dtype=torch.float64), "", torch.zeros((), dtype=torch.float64)
    for pname, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        err = (grad.double() - ref_params[pname].grad.double()).abs().max()
        scale = torch.maximum(scale, ref_params[pname].grad.double().abs().max())
        if err > worst:
            worst, worst_name = err, pname
    both = torch.stack([fwd, worst, ref_out.double().abs().max(), scale])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return [float(x) for x in both], worst_name


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="flux")
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--ulysses", type=int, default=1)
    parser.add_argument("--text-mask", default="fixture", choices=("fixture", "none", "pad"),
                        help="qwenimage: the fixture's all-ones mask, no mask, or the last three text tokens padded")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cases", default="plain")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dtype = getattr(torch, args.dtype)
    cls, init, inputs = build(args.model, args.text_mask)
    torch.manual_seed(0)
    reference = cls(**init).to(dtype).eval()
    inputs = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    weights = torch.randn(reference(**inputs, return_dict=False)[0].shape,
                          generator=torch.Generator().manual_seed(1234)).to(dtype)
    ref_out = run(reference, inputs, weights)
    cp = dict(ring_degree=args.ring, ulysses_degree=args.ulysses)
    for name in args.cases.split(","):
        try:
            (fwd, grads, out_scale, grad_scale), where = case(name, reference, ref_out, inputs, weights, cp, dtype)
            line = (f"fwd_max_abs={fwd:.3e} (max|ref| {out_scale:.2g}) grad_max_abs={grads:.3e} "
                    f"(max|ref grad| {grad_scale:.2g}; worst: {where})")
        except Exception as exc:  # a library error is a finding, reported per rank
            line = f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
            print(f"[rank{dist.get_rank()}] {args.model} r{args.ring}xu{args.ulysses} {name}: {line}", flush=True)
            break
        if dist.get_rank() == 0:
            line += f" unwaited_works={torch._C._distributed_c10d._get_work_registry_size()}"
            mask = f" text-mask={args.text_mask}" if args.model == "qwenimage" else ""
            print(f"{args.model}{mask} {args.dtype} r{args.ring}xu{args.ulysses} {name}: {line}", flush=True)
    # Diffusers' ring all-gathers are consumed through views and never explicitly waited; tearing gloo
    # down while a peer may still hold such work aborts a rank now and then. A barrier first avoids it.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
