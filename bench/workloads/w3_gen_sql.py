#!/usr/bin/python3
"""W3: write a SQL script of inserts, an index and updates for the sqlite3 CLI.

    w3_gen_sql.py OUT.sql [ROWS]      then   sqlite3 :memory: ".read OUT.sql"
"""
import random
import sys

out = sys.argv[1]
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 60000
rng = random.Random(4)
with open(out, "w") as f:
    f.write("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, grp INTEGER, v REAL);\n")
    f.write("BEGIN;\n")
    for i in range(rows):
        f.write("INSERT INTO t(name, grp, v) VALUES('name-%d-%s', %d, %f);\n"
                % (i, "x" * rng.randint(1, 40), rng.randint(0, 999), rng.random()))
    f.write("COMMIT;\n")
    f.write("CREATE INDEX t_grp ON t(grp);\n")
    f.write("BEGIN;\n")
    for g in range(0, 1000, 2):
        f.write("UPDATE t SET v = v * 2, name = name || '-u' WHERE grp = %d;\n" % g)
    f.write("COMMIT;\n")
    f.write("SELECT grp, count(*), sum(v) FROM t GROUP BY grp ORDER BY 3 DESC LIMIT 3;\n")
