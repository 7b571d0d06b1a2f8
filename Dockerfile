# The router image the manifests in deploy/kubernetes/ name (trio-router:0.1.0):
#   docker build -t trio-router:0.1.0 .
# The project's wheel is built in a first stage (the request path compiled with mypyc,
# setup.py: gcc there only) and installed alone in a slim image that runs as a non-root
# user, with `router serve` as the entrypoint.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY router ./router
COPY conformance ./conformance
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home router
USER 10001
EXPOSE 8080
ENTRYPOINT ["router", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8080"]
