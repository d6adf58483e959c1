set -x
export NIMBLE_CACHE_DIR=$(mktemp -d)
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
git log --oneline | head -1 > $OUT/commit.txt
python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt | tail -3
# a traced detection model through the plain CLI: nimble imports torchvision to load it
python3 - <<'PY' > $OUT/detection_cli.txt 2>&1
import sys, subprocess, torch, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, "benchmarks")
import zoo
tv = zoo.import_torchvision()
torch.manual_seed(0)
m = zoo.Detections(tv.models.get_model("fasterrcnn_mobilenet_v3_large_320_fpn", weights=None, weights_backbone=None).eval())
with torch.no_grad():
    torch.jit.save(torch.jit.trace(m, (torch.rand(1, 3, 224, 224),), check_trace=False, strict=False), "/tmp/det.pt")
p = subprocess.run([sys.executable, "-c", "from nimble.cli.entry import main; main()", "compile", "/tmp/det.pt",
                    "--shape", "1x3x224x224", "--device", "cpu", "-o", "/tmp/det.nimble"], capture_output=True, text=True)
print("exit", p.returncode); print(p.stderr[-1500:])
PY
tail -3 $OUT/detection_cli.txt
timeout 330 python3 benchmarks/zoo.py --groups classification --models vit_b_16 vit_b_32 resnet50 swin_t --timeout 120 --out $OUT/zoo_cls > $OUT/zoo_cls.log 2>&1
timeout 200 python3 benchmarks/zoo.py --groups detection --models fasterrcnn_mobilenet_v3_large_320_fpn ssdlite320_mobilenet_v3_large retinanet_resnet50_fpn --timeout 120 --out $OUT/zoo_det > $OUT/zoo_det.log 2>&1
grep -o '"same_op_kinds": [a-z]*' $OUT/zoo_cls.log; grep -c '"status": "ok"' $OUT/zoo_cls.log
