# W1: build 50k small dicts and round-trip them through json. Run with
# PYTHONMALLOC=malloc /usr/bin/python3 so every object goes through malloc.
import json

data = [{"id": i, "name": "item%d" % i, "tags": ["a", "b", str(i)], "score": i * 0.5} for i in range(50000)]
text = json.dumps(data)
back = json.loads(text)
assert len(back) == 50000 and back[49999]["id"] == 49999
