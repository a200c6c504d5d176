# syntax=docker/dockerfile:1
# The relay's container image, in three stages:
#   build   — Debian's Python 3.11 (PGO+LTO) in a venv with the project, whose package build
#             (setup.py) compiles mst's hot path with mypyc and the C mst._accel (libcrypto);
#             compilers, headers and mypy stay in this stage
#   runtime — the venv alone on a slim Debian, as an unprivileged user (target `runtime`, the default
#             image the Helm chart's `image` names)
#   spark   — runtime plus Java 17 and the PostgreSQL JDBC driver, for `relay spark …` (the chart's
#             `sparkImage`)
#   docker build -t atproto-relay --target runtime .
#   docker build -t atproto-relay-spark --target spark .
# Reproducible inputs: the base image by digest (its multi-platform index, so amd64 and arm64 build
# alike) and every Python package at the version in constraints.txt. Refresh the digest with
#   docker buildx imagetools inspect debian:bookworm-slim   (the "Digest:" line)
# and the constraints with `.venv/bin/python -m tests.ops.constraints > constraints.txt`.
ARG DEBIAN=debian:bookworm-slim@sha256:e899040a73d36e2b36fa33216943539d9957cba8172b858097c2cabcdb20a3e2

FROM ${DEBIAN} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/relay/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM base AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev python3.11-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, in a layer that changes only with pyproject.toml or constraints.txt: the
# project's requirements and its build requirements ([build-system] requires: setuptools and mypy,
# for the mst build) read from pyproject.toml, at the pinned versions; pyspark (and pyarrow) only in
# the spark stage. Behind a TLS-intercepting proxy, pass its CA bundle:
# --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
COPY pyproject.toml constraints.txt ./
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python3.11 -m venv /opt/relay \
 && /opt/relay/bin/pip install --no-cache-dir -c constraints.txt --upgrade pip \
 && python3.11 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"]))' > requirements.txt \
 && /opt/relay/bin/pip install --no-cache-dir -c constraints.txt -r requirements.txt
COPY README.md setup.py ./
COPY mst ./mst
COPY firehose ./firehose
COPY backfill ./backfill
COPY relay ./relay
COPY spark ./spark
COPY sim ./sim
# the project itself (not editable), built with the pinned setuptools and mypy (its build compiles
# mst._native_node / _invert / _car; RELAY_REQUIRE_COMPILED makes a failed compile fail the image);
# its dependencies are already there. Then the build requirements' Python side goes.
RUN RELAY_REQUIRE_COMPILED=1 /opt/relay/bin/pip install --no-cache-dir --no-deps --no-build-isolation . \
 && relay native status | grep -q "mst: compiled" \
 && /opt/relay/bin/pip uninstall -y mypy librt ast-serialize pathspec mypy-extensions \
 && /opt/relay/bin/pip check

FROM base AS runtime
RUN groupadd --system --gid 10001 relay \
 && useradd --system --uid 10001 --gid relay --home-dir /nonexistent --shell /usr/sbin/nologin relay
COPY --from=build /opt/relay /opt/relay
USER 10001:10001
WORKDIR /tmp
EXPOSE 2470
# /_health answers 200 in every phase once the port is open (Kubernetes uses its own probes)
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["/opt/relay/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:2470/_health', timeout=4)"]
# `relay serve` (SQLite under ./data) unless the chart says ingest / fanout
ENTRYPOINT ["relay"]
CMD ["serve", "--bind", "0.0.0.0:2470", "--database-url", "/tmp/data/relay.sqlite"]

FROM runtime AS spark
USER 0
# default-jre-headless: Java 17 on bookworm, and /usr/lib/jvm/default-java on every architecture
RUN apt-get update \
 && apt-get install -y --no-install-recommends default-jre-headless libpostgresql-jdbc-java procps \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml constraints.txt /tmp/build/
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/relay/bin/python -c 'import tomllib; p = tomllib.load(open("/tmp/build/pyproject.toml", "rb"))["project"]; print("\n".join(p["optional-dependencies"]["spark"]))' > /tmp/build/spark.txt \
 && /opt/relay/bin/pip install --no-cache-dir -c /tmp/build/constraints.txt -r /tmp/build/spark.txt \
 && rm -rf /tmp/build
ENV JAVA_HOME=/usr/lib/jvm/default-java
# a batch job, not a server
HEALTHCHECK NONE
USER 10001:10001
CMD ["spark", "--help"]
