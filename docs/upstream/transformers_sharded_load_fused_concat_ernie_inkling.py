"""transformers 5.25.0: an fsdp load of Ernie 4.5 VL and Inkling2-Loop (image-text) raises on a per-shard conversion.

    PYTHONPATH=. python docs/upstream/transformers_sharded_load_fused_concat_ernie_inkling.py   # 2 gloo ranks

Uses the kit only to make each family's tiny config (`sweep.fitted`); the load is plain transformers. Each rank
prints whether `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))` loaded, and transformers'
load report names the mismatched parameters (Ernie's router gates and e_score_correction_bias, Inkling2-Loop's
message_input.query).
"""
import os, tempfile, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist, torch.multiprocessing as mp
WORLD = 2
FAMS = ["ernie4_5_vl_moe", "inkling2_loop"]
def rank(r, root):
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, "store"), WORLD), rank=r, world_size=WORLD)
    from transformers import AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig
    for mt in FAMS:
        try:
            AutoModelForImageTextToText.from_pretrained(os.path.join(root, mt), dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=WORLD))
            print(r, mt, "loaded", flush=True)
        except Exception as e:
            print(r, mt, "raised", type(e).__name__, str(e)[:100], flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    import logging; logging.disable(logging.WARNING)
    import transformers
    from paracheck.adapters.transformers import sweep
    root = tempfile.mkdtemp(prefix="h42b-e", dir="/tmp/h42b-bt")
    for mt in FAMS:
        fam = sweep.fitted([f for f in sweep.families([mt + "-image-text"])][0], 2)
        torch.manual_seed(0)
        transformers.AutoModelForImageTextToText.from_config(fam.config, dtype=torch.float32).save_pretrained(os.path.join(root, mt))
    logging.disable(logging.NOTSET)
    mp.spawn(rank, args=(root,), nprocs=WORLD)
