"""The embedded database (SQLite, no DATABASE_URL) under the concurrency `make run` gives it: Daphne's request
threads and in-process tasks writing at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Writer A holds the write lock; B reads and then writes in one transaction while A still holds it. SQLite cannot
# make B's read wait, so in its default (deferred) mode B fails with "database is locked" instead of waiting.
TWO_WRITERS = """
import threading, time
from django.db import connection, transaction
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE IF NOT EXISTS demo_rows (n integer)")
connection.close()
a_wrote, outcome = threading.Event(), []

def writer_a():
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO demo_rows VALUES (1)")
        a_wrote.set()
        time.sleep(0.5)
    connection.close()

def writer_b():
    a_wrote.wait()
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM demo_rows")
                cursor.execute("INSERT INTO demo_rows VALUES (2)")
        outcome.append("committed")
    except Exception as exc:
        outcome.append(f"failed: {exc}")
    connection.close()

threads = [threading.Thread(target=writer_a), threading.Thread(target=writer_b)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
with connection.cursor() as cursor:
    cursor.execute("SELECT count(*) FROM demo_rows")
    print("B", outcome[0], "rows", cursor.fetchone()[0])
"""


def test_a_transaction_that_reads_then_writes_waits_for_another_writer_on_the_embedded_database(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMINSIGHT_", "DJANGO_"))}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    env["COMMINSIGHT_SERVER_DATA_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", TWO_WRITERS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "B committed rows 2"
