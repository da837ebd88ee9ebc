# W1: build 50k small dicts and round-trip them through json. Run with
# PYTHONMALLOC=malloc /usr/bin/python3 so every object goes through malloc.
#   w1_json_dicts.py [N [ROUNDS]]   N dicts (default 50000); the whole round
#   trip ROUNDS times (default 1), each round's objects freed before the next
#   (bench/memory: more events, the same live blocks).
import json
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 50000
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
for r in range(rounds):
    data = [{"id": i, "name": "item%d" % i, "tags": ["a", "b", str(i)], "score": i * 0.5} for i in range(n)]
    text = json.dumps(data)
    back = json.loads(text)
    assert len(back) == n and back[n - 1]["id"] == n - 1
    if r + 1 < rounds:
        del data, text, back
