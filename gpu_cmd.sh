set -x
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
python3 -m pytest -m gpu -q -x -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "pytest rc $?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
nimble compile sample_models/inception.pt -s 1x3x224x224 -o /tmp/inc.nimble > $OUT/compile.log 2>&1
nimble bench /tmp/inc.nimble --duration-s 0.5 --no-baselines --trace $OUT/inc_trace.json > $OUT/bench_trace.log 2>&1; echo "bench rc $?"
tail -5 $OUT/bench_trace.log
cd benchmarks && timeout 240 python3 canonical_order.py --models nasnet resnet18 --out $OUT > $OUT/canonical.log 2>&1; echo "canon rc $?"; tail -20 $OUT/canonical.log
