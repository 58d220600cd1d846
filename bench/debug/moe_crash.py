"""Reproducer: MoE layer device path at T=1024 (mxfp4, V4-Flash shard). Run with CUDA_LAUNCH_BLOCKING=1."""
import sys, traceback, torch
from moe import MoEConfig, MoELayer
from parallel.ep import static
case = sys.argv[1]
torch.manual_seed(0)
cfg = MoEConfig.deepseek_v4_flash(num_experts=32, expert_format="mxfp4")
layer = MoELayer(cfg, device="cuda", path="host" if case == "host" else "device")
T = int(sys.argv[2])
x = torch.randn(T, cfg.hidden, device="cuda").bfloat16()
if case == "torchplan":
    static.TRITON_PLAN_MAX_PAIRS = 0
if case == "tritonplan":
    static.TRITON_PLAN_MAX_PAIRS = 10**9
if case == "noside":
    layer._side_stream = lambda x: None
try:
    with torch.inference_mode():
        for _ in range(3):
            y = layer(x)
        torch.cuda.synchronize()
    print(case, T, "OK", float(y.float().norm()))
except Exception:
    traceback.print_exc(limit=6)
    print(case, T, "FAILED")
