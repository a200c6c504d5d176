# syntax=docker/dockerfile:1
# The relay's container image, in three stages:
#   build   — Debian's Python 3.11 (PGO+LTO) in a venv with the project, and the compiled mst build
#             (mypyc, `relay native build`) in it; compilers and mypy stay in this stage
#   runtime — the venv alone on a slim Debian, as an unprivileged user (target `runtime`, the default
#             image the Helm chart's `image` names)
#   spark   — runtime plus Java 17 and the PostgreSQL JDBC driver, for `relay spark …` (the chart's
#             `sparkImage`)
#   docker build -t atproto-relay --target runtime .
#   docker build -t atproto-relay-spark --target spark .
ARG DEBIAN=debian:bookworm-slim

FROM ${DEBIAN} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/relay/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM base AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev python3.11-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mst ./mst
COPY firehose ./firehose
COPY backfill ./backfill
COPY relay ./relay
COPY spark ./spark
COPY migrations ./migrations
# the project (not editable) and its dependencies; pyspark (and pyarrow) only in the spark stage. Behind a
# TLS-intercepting proxy, pass its CA bundle: --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python3.11 -m venv /opt/relay \
 && /opt/relay/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/relay/bin/pip install --no-cache-dir ".[native]"
# compile mst.node / mst.invert / mst.car into site-packages/.native (checked against the sources'
# SHA-256 at import), then drop the compiler toolchain's Python side
RUN relay native build \
 && relay native status | grep -q "native build: ok" \
 && /opt/relay/bin/pip uninstall -y mypy
# migrations are read from beside the packages
RUN cp -r migrations "$(/opt/relay/bin/python -I -c 'import backfill, pathlib; print(pathlib.Path(backfill.__file__).parent.parent)')/"

FROM base AS runtime
RUN groupadd --system --gid 10001 relay \
 && useradd --system --uid 10001 --gid relay --home-dir /nonexistent --shell /usr/sbin/nologin relay
COPY --from=build /opt/relay /opt/relay
USER 10001:10001
WORKDIR /tmp
EXPOSE 2470
# `relay serve` (SQLite under ./data) unless the chart says ingest / fanout
ENTRYPOINT ["relay"]
CMD ["serve", "--bind", "0.0.0.0:2470", "--database-url", "/tmp/data/relay.sqlite"]

FROM runtime AS spark
USER 0
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless libpostgresql-jdbc-java procps \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/relay/bin/pip install --no-cache-dir "pyspark>=3.5" "pyarrow>=15"
ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64
USER 10001:10001
CMD ["spark", "--help"]
