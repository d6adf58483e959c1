python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
timeout 300 python3 -m pytest -q -m gpu tests/runtime/test_gpu_kernels.py tests/runtime/test_gpu_runtime.py -x > $OUT/gpu_tests.log 2>&1; echo tests rc=$?
tail -2 $OUT/gpu_tests.log; grep -E "^E" $OUT/gpu_tests.log | head -20
mkdir -p $OUT/peers
for m in gpt2 swin_t; do
timeout 130 python3 benchmarks/peers.py --models $m --batches 1 --out $OUT/peers --tag ${m}_b1 > $OUT/peers_$m.log 2>&1; echo $m rc=$?
tail -1 $OUT/peers_$m.log | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(r['model'], r['gpu_bound_ms'], r['latency_ms'], r['choice'], r['kernels'], r['kernel_fallbacks'])"
done
