python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/r
timeout 330 python3 -m pytest -q -p no:cacheprovider -x > $OUT/r/all_tests.txt 2>&1; echo "exit $?" >> $OUT/r/all_tests.txt
python3 - <<'PY' > /dev/null 2>&1
import torch, torchvision
torch.manual_seed(0)
m = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False).eval()
x = torch.randn(1, 3, 299, 299)
with torch.no_grad():
    torch.jit.save(torch.jit.trace(m, x), "/tmp/inception_v3.pt")
torch.export.save(torch.export.export(m, (x,)), "/tmp/inception_v3.pt2")
torch.manual_seed(0)
v = torchvision.models.vit_b_16(weights=None).eval()
torch.export.save(torch.export.export(v, (torch.randn(1, 3, 224, 224),)), "/tmp/vit_b_16.pt2")
PY
nimble compile /tmp/inception_v3.pt --shape 1x3x299x299 -o /tmp/iv3.nimble --json > $OUT/r/compile_inception_v3.json 2> $OUT/r/compile_inception_v3.err
nimble compile /tmp/inception_v3.pt2 -o /tmp/iv3x.nimble --json > $OUT/r/compile_inception_v3_pt2.json 2>> $OUT/r/compile_inception_v3.err
nimble compile /tmp/vit_b_16.pt2 -o /tmp/vit.nimble --json > $OUT/r/compile_vit_b_16_pt2.json 2> $OUT/r/vit.err
nimble run /tmp/vit.nimble --check >> $OUT/r/vit.err 2>&1; echo "exit $?" >> $OUT/r/vit.err
nimble bench /tmp/iv3.nimble --json > $OUT/r/bench_inception_v3.json 2> $OUT/r/bench_inception_v3.err
tail -2 $OUT/r/all_tests.txt; tail -3 $OUT/r/vit.err
