export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m mtjax.bench --config configs/llama_3b.yaml --warmup 1 --steps 3 --systems mtjax,roofline --out $OUT/h200.json --timeline $OUT/h200_3b_b8_dev8_timeline.png --variant "dev8:engine.device_update_layers=8" --variant "dev14:engine.device_update_layers=14" 2>&1 | grep -v "^W1202\|bfc_allocator"
for shape in llama_7b llama_9b; do
  python3 -m mtjax.train --config configs/$shape.yaml --no-progress --json $OUT/$shape.json train.steps=4
done
