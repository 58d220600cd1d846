#!/usr/bin/env bash
# Why DeepGEMM's JIT runtime segfaults at its first kernel call on the GPU machine unless the
# system libstdc++ is preloaded. Run on the GPU machine from the project root, with deep_gemm
# importable and LD_PRELOAD unset. Prints: the libstdc++ copies mapped into the process, which
# object each C++ runtime symbol of deep_gemm's extension binds to (LD_DEBUG=bindings), the
# GLIBCXX versions each copy provides and the extension needs, and the crash itself.
set -uo pipefail
unset LD_PRELOAD
log=${1:-/tmp/deepgemm-diag}; mkdir -p "$log"
echo "== toolchain"; gcc --version | head -1; nvcc --version | tail -2; python3 -VV
so=$(python3 -c "import deep_gemm._C as c; print(c.__file__)" 2>/dev/null)
echo "== deep_gemm extension: $so"; ldd "$so" | grep -E "stdc|gcc_s|torch|python" || true
echo "== GLIBCXX the extension needs (newest)"
objdump -T "$so" 2>/dev/null | grep -o "GLIBCXX_3\.4\.[0-9]*" | sort -uV | tail -3
python3 - <<'PY'
import re, sys
def mapped():
    return sorted({l.split()[-1] for l in open("/proc/self/maps") if re.search(r"libstdc\+\+|libgcc_s", l)})
print("== python", sys.executable)
print("libstdc++ before torch:", mapped())
import torch
print("after torch:", mapped())
import deep_gemm
print("after deep_gemm:", mapped())
for path in mapped():
    if "libstdc++" in path:
        data = open(path, "rb").read()
        vers = sorted(set(re.findall(rb"GLIBCXX_3\.4\.(\d+)", data)), key=int)
        print(path, "provides up to GLIBCXX_3.4." + vers[-1].decode() if vers else "(no versions)")
PY
echo "== libraries that carry their own C++ runtime symbols (exported std::locale::classic)"
python3 - <<'PY'
import re, subprocess
seen = set()
import torch, deep_gemm  # noqa: F401
for l in open("/proc/self/maps"):
    p = l.split()[-1]
    if p.endswith(".so") or ".so." in p:
        if p in seen:
            continue
        seen.add(p)
        out = subprocess.run(["nm", "-D", "--defined-only", p], capture_output=True, text=True).stdout
        if "_ZNSt6locale7classicEv" in out or "_ZNSt6localeC1Ev" in out:
            print(p)
PY
cat > "$log/first_call.py" <<'PY'
import faulthandler; faulthandler.enable()
import torch, deep_gemm
a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
d = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
deep_gemm.bf16_gemm_nt(a, b, d)
torch.cuda.synchronize()
print("first call ok, max err", (d.float() - a.float() @ b.float().t()).abs().max().item())
PY
echo "== first call without LD_PRELOAD (bindings in $log/bindings.txt)"
LD_DEBUG=bindings LD_DEBUG_OUTPUT=$log/ld python3 "$log/first_call.py" 2>&1 | tail -15; echo "rc=${PIPESTATUS[0]}"
big=$(ls -S "$log"/ld.* 2>/dev/null | head -1)
strip() { sed -E 's/^ *[0-9]+: *//'; }  # "binding file FROM [0] to TO [0]: normal symbol `NAME' [VER]"
grep -E "deep_gemm|_C\.cpython" "$big" | grep "binding file" | strip | grep -E "locale|ctype|regex|facet" \
  | awk '{print $3, "->", $6, $10}' | sort | uniq -c | sort -rn | head -25 | tee "$log/bindings.txt"
echo "== the last bindings before the process ended (the crash site's callees)"
grep "binding file" "$big" | strip | tail -25 | awk '{print $3, "->", $6, $10}'
echo "== every object a std::locale / ctype / facet symbol was bound to"
grep "binding file" "$big" | strip | grep -E "symbol .(_ZNSt6locale|_ZNKSt5ctype|_ZNSt5ctype|_ZSt9use_facet|_ZSt9has_facet)" \
  | awk '{print $6}' | sort | uniq -c | sort -rn | head
rm -f "$log"/ld.*
if command -v gdb >/dev/null; then
  echo "== gdb backtrace"; gdb -q -batch -ex run -ex bt --args python3 "$log/first_call.py" 2>&1 | grep -E "^#" | head -25
fi
echo "== first call with LD_PRELOAD of the system libstdc++"
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python3 "$log/first_call.py" 2>&1 | tail -3
