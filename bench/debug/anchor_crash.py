"""Reproducer: the bench's plain-torch anchor at T tokens (V4-Flash shard). CUDA_LAUNCH_BLOCKING=1."""
import sys, traceback, torch
from moe import MoEConfig, MoELayer
from launch.bench.moe import _anchor_weights, plain_torch_moe, _shard_config
torch.manual_seed(0)
layer = MoELayer(_shard_config(sys.argv[1], "mxfp4", torch.bfloat16), device="cuda")
w = _anchor_weights(layer)
for T in (256, 1024, 4096):
    x = torch.randn(T, layer.config.hidden, device="cuda").bfloat16()
    try:
        with torch.inference_mode():
            y = plain_torch_moe(x, w, layer.config); torch.cuda.synchronize()
            z = layer(x); torch.cuda.synchronize()
        print("anchor", T, "OK", float((y.float() - z.float()).norm() / z.float().norm()))
    except Exception:
        traceback.print_exc(limit=4); print("anchor", T, "FAILED"); break
