# Builds the worker image used by docker-compose.yml.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --bin device-list-updater

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/device-list-updater /usr/local/bin/device-list-updater
ENTRYPOINT ["device-list-updater"]
CMD ["run"]
