#!/usr/bin/env python3
"""Test harness for tests/synapse.rs: a real Synapse on loopback.

Run with the Python that has matrix-synapse installed (scripts/synapse-python).

  harness.py setup DIR SYNAPSE_PORT NAMES(on|off)
      writes a throw-away CA and certificate, Synapse's homeserver.yaml and
      signing key into DIR.
  harness.py keyserver DIR OUR_KEY_FILE
      serves our key at https://127.0.0.1:<port>/_matrix/key/v2/server on a
      free port (Synapse fetches it over HTTPS to check our X-Matrix
      signatures); prints {"server_name": "127.0.0.1:<port>"} once listening:
      that is our server name.
  harness.py populate DIR SYNAPSE_PORT      users, devices, keys
  harness.py change DIR SYNAPSE_PORT        rename, add and delete devices
  harness.py truth DIR SYNAPSE_PORT         what Synapse holds, as JSON

Everything is made through the client-server API as real clients do. The
other commands print one JSON object on stdout.
"""

import datetime
import hashlib
import hmac
import http.server
import ipaddress
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request

import signedjson.key
import signedjson.sign
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from unpaddedbase64 import encode_base64

SERVER_NAME = "remote.test"
SHARED_SECRET = "dlu-test-shared-secret"
PASSWORD = "correct horse battery staple"

# Synapse's default ip_range_blacklist without 127.0.0.0/8: its federation
# client checks IP-literal server names against this list without the
# whitelist, and our server name is 127.0.0.1:<port>.
IP_BLACKLIST = [
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
    "192.0.0.0/24", "169.254.0.0/16", "192.88.99.0/24", "198.18.0.0/15",
    "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4",
    "::1/128", "fe80::/10", "fc00::/7", "2001:db8::/32", "ff00::/8", "fec0::/10",
]


def write_certificates(directory):
    """A CA and a certificate for 127.0.0.1 and localhost signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dlu test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    with open(os.path.join(directory, "ca.pem"), "wb") as f:
        f.write(ca.public_bytes(pem))
    with open(os.path.join(directory, "server.pem"), "wb") as f:
        f.write(cert.public_bytes(pem))
    with open(os.path.join(directory, "server.key"), "wb") as f:
        f.write(
            key.private_bytes(
                pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


def setup(directory, synapse_port, names):
    write_certificates(directory)
    with open(os.path.join(directory, "synapse.signing.key"), "w") as f:
        signedjson.key.write_signing_keys(f, [signedjson.key.generate_signing_key("a")])
    log_config = os.path.join(directory, "log.yaml")
    with open(log_config, "w") as f:
        f.write(
            "version: 1\n"
            "formatters: {plain: {format: '%(asctime)s %(name)s %(levelname)s %(message)s'}}\n"
            f"handlers: {{file: {{class: logging.FileHandler, filename: '{directory}/synapse.log', formatter: plain}}}}\n"
            "root: {level: INFO, handlers: [file]}\n"
            "disable_existing_loggers: false\n"
        )
    config = {
        "server_name": SERVER_NAME,
        "pid_file": os.path.join(directory, "synapse.pid"),
        "listeners": [
            {
                "port": int(synapse_port),
                "bind_addresses": ["127.0.0.1"],
                "type": "http",
                "tls": False,
                "x_forwarded": False,
                "resources": [{"names": ["client", "federation"], "compress": False}],
            }
        ],
        "database": {
            "name": "sqlite3",
            "args": {"database": os.path.join(directory, "homeserver.db")},
        },
        "log_config": log_config,
        "media_store_path": os.path.join(directory, "media"),
        "signing_key_path": os.path.join(directory, "synapse.signing.key"),
        "registration_shared_secret": SHARED_SECRET,
        "macaroon_secret_key": "dlu-test-macaroon",
        "form_secret": "dlu-test-form",
        "report_stats": False,
        "enable_metrics": False,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "federation_verify_certificates": True,
        "federation_custom_ca_list": [os.path.join(directory, "ca.pem")],
        "ip_range_blacklist": IP_BLACKLIST,
        "ip_range_whitelist": ["127.0.0.1/32"],
        "allow_device_name_lookup_over_federation": names == "on",
        "rc_login": {
            "address": {"per_second": 1000, "burst_count": 1000},
            "account": {"per_second": 1000, "burst_count": 1000},
            "failed_attempts": {"per_second": 1000, "burst_count": 1000},
        },
        "rc_federation": {"window_size": 1000, "sleep_limit": 1000, "reject_limit": 1000},
        "rc_message": {"per_second": 1000, "burst_count": 1000},
    }
    # JSON is YAML.
    with open(os.path.join(directory, "homeserver.yaml"), "w") as f:
        json.dump(config, f, indent=1)
    print(json.dumps({"config": os.path.join(directory, "homeserver.yaml")}))


def keyserver(directory, our_key_file):
    with open(our_key_file) as f:
        key = signedjson.key.read_signing_keys(f)[0]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), None)
    origin = f"127.0.0.1:{server.server_address[1]}"
    key_id = f"{key.alg}:{key.version}"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if not self.path.startswith("/_matrix/key/v2/server"):
                self.send_response(404)
                self.end_headers()
                return
            body = {
                "server_name": origin,
                "valid_until_ts": int(time.time() * 1000) + 24 * 3600 * 1000,
                "verify_keys": {
                    key_id: {"key": encode_base64(key.verify_key.encode())}
                },
                "old_verify_keys": {},
            }
            body = signedjson.sign.sign_json(body, origin, key)
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            with open(os.path.join(directory, "key_requests.log"), "a") as log:
                log.write(self.path + "\n")

        def log_message(self, *args):
            pass

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(
        os.path.join(directory, "server.pem"), os.path.join(directory, "server.key")
    )
    server.RequestHandlerClass = Handler
    server.socket = context.wrap_socket(server.socket, server_side=True)
    print(json.dumps({"server_name": origin}), flush=True)
    server.serve_forever()


class Client:
    """The client-server API of the Synapse under test."""

    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def call(self, method, path, body=None, token=None, ok=(200,)):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            answer = json.loads(e.read() or b"{}")
            if e.code in ok:
                return e.code, answer
            raise SystemExit(f"{method} {path}: {e.code} {answer}")

    def register(self, localpart):
        _, nonce = self.call("GET", "/_synapse/admin/v1/register")
        mac = hmac.new(SHARED_SECRET.encode(), digestmod=hashlib.sha1)
        mac.update(b"\x00".join([nonce["nonce"].encode(), localpart.encode(), PASSWORD.encode(), b"notadmin"]))
        self.call(
            "POST",
            "/_synapse/admin/v1/register",
            {"nonce": nonce["nonce"], "username": localpart, "password": PASSWORD, "mac": mac.hexdigest()},
        )

    def login(self, localpart, device_id, display_name):
        _, answer = self.call(
            "POST",
            "/_matrix/client/v3/login",
            {
                "type": "m.login.password",
                "identifier": {"type": "m.id.user", "user": localpart},
                "password": PASSWORD,
                "device_id": device_id,
                "initial_device_display_name": display_name,
            },
        )
        return answer["access_token"]

    def with_auth(self, method, path, body, token, localpart):
        """A call behind user-interactive auth (password), as clients do it."""
        status, answer = self.call(method, path, body, token, ok=(200, 401))
        if status == 200:
            return answer
        body = dict(body or {})
        body["auth"] = {
            "type": "m.login.password",
            "identifier": {"type": "m.id.user", "user": localpart},
            "password": PASSWORD,
            "session": answer.get("session"),
        }
        return self.call(method, path, body, token)[1]


def user_id(localpart):
    return f"@{localpart}:{SERVER_NAME}"


def upload_device_keys(client, token, localpart, device_id):
    key = signedjson.key.generate_signing_key(device_id)
    curve = encode_base64(os.urandom(32))
    keys = {
        "user_id": user_id(localpart),
        "device_id": device_id,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {
            f"curve25519:{device_id}": curve,
            f"ed25519:{device_id}": encode_base64(key.verify_key.encode()),
        },
    }
    keys = signedjson.sign.sign_json(keys, user_id(localpart), key)
    client.call("POST", "/_matrix/client/v3/keys/upload", {"device_keys": keys}, token)


def upload_cross_signing(client, token, localpart):
    master = signedjson.key.generate_signing_key("m")
    master_pub = encode_base64(master.verify_key.encode())
    self_signing = signedjson.key.generate_signing_key("s")
    self_pub = encode_base64(self_signing.verify_key.encode())
    user = user_id(localpart)
    master_key = {"user_id": user, "usage": ["master"], "keys": {f"ed25519:{master_pub}": master_pub}}
    self_key = {"user_id": user, "usage": ["self_signing"], "keys": {f"ed25519:{self_pub}": self_pub}}
    master.version = master_pub
    self_key = signedjson.sign.sign_json(self_key, user, master)
    client.with_auth(
        "POST",
        "/_matrix/client/v3/keys/device_signing/upload",
        {"master_key": master_key, "self_signing_key": self_key},
        token,
        localpart,
    )


USERS = [user_id("alice"), user_id("bob"), user_id("carol/q+r=s")]


def state_path(directory):
    return os.path.join(directory, "state.json")


def populate(directory, port):
    client = Client(port)
    tokens = {}
    for localpart, devices, cross_signing in [
        ("alice", [("ALICEPHONE", "Alice's phone"), ("ALICELAPTOP", "Alice's laptop")], True),
        ("bob", [("BOBPHONE", "Bob's phone"), ("BOBNOKEYS", "Bob without keys")], False),
        # Characters that must be percent-encoded in the request path.
        ("carol/q+r=s", [("CAROLPHONE", "Carol's phone")], False),
    ]:
        client.register(localpart)
        for device_id, name in devices:
            token = client.login(localpart, device_id, name)
            tokens[device_id] = token
            if device_id != "BOBNOKEYS":
                upload_device_keys(client, token, localpart, device_id)
        if cross_signing:
            upload_cross_signing(client, tokens[devices[0][0]], localpart)
    with open(state_path(directory), "w") as f:
        json.dump(tokens, f)
    print(json.dumps({"users": USERS}))


def change(directory, port):
    client = Client(port)
    with open(state_path(directory)) as f:
        tokens = json.load(f)
    phone = tokens["ALICEPHONE"]
    client.call("PUT", "/_matrix/client/v3/devices/ALICEPHONE", {"display_name": "Alice's new phone"}, phone)
    tokens["ALICETABLET"] = client.login("alice", "ALICETABLET", "Alice's tablet")
    upload_device_keys(client, tokens["ALICETABLET"], "alice", "ALICETABLET")
    client.with_auth("DELETE", "/_matrix/client/v3/devices/ALICELAPTOP", {}, phone, "alice")
    with open(state_path(directory), "w") as f:
        json.dump(tokens, f)
    print(json.dumps({"changed": ["ALICEPHONE", "ALICETABLET", "ALICELAPTOP"]}))


def truth(directory, port):
    """What Synapse holds for each user: devices with keys and display
    names, and the cross-signing keys, read as a local client sees them."""
    client = Client(port)
    with open(state_path(directory)) as f:
        tokens = json.load(f)
    users = USERS
    _, answer = client.call(
        "POST",
        "/_matrix/client/v3/keys/query",
        {"device_keys": {u: [] for u in users}},
        tokens["ALICEPHONE"],
    )
    out = {}
    for user in users:
        devices = {}
        for device_id, keys in answer.get("device_keys", {}).get(user, {}).items():
            name = keys.get("unsigned", {}).get("device_display_name")
            devices[device_id] = {"keys": keys["keys"], "display_name": name}
        out[user] = {
            "devices": devices,
            "master_key": answer.get("master_keys", {}).get(user, {}).get("keys"),
            "self_signing_key": answer.get("self_signing_keys", {}).get(user, {}).get("keys"),
        }
    print(json.dumps(out))


def main():
    command, args = sys.argv[1], sys.argv[2:]
    {"setup": setup, "keyserver": keyserver, "populate": populate, "change": change, "truth": truth}[command](*args)


if __name__ == "__main__":
    main()
