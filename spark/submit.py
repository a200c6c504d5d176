"""Entry file for ``spark-submit`` (the master and resources come from spark-submit's options):

    spark-submit --master spark://… --py-files dist/relay-spark.zip spark/submit.py resync --db …

Same options as ``relay spark``; see ``spark/README.md``.
"""

from __future__ import annotations

import sys

from spark.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], default_master=None))
