"""Entry file for ``spark-submit`` (the master and resources come from spark-submit's options):

    spark-submit --master spark://… --py-files dist/relay-spark.zip spark/submit.py resync --db …

Same options as ``relay spark``; see ``spark/README.md``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # spark-submit puts this file's folder (spark/) first on sys.path; the package must be
    # imported as ``spark.*`` from the project root or the --py-files zip instead.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]

    from spark.cli import main

    sys.exit(main(sys.argv[1:], default_master=None))
