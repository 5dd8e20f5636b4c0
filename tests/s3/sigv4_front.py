#!/usr/bin/python3
"""The signature-verifying front of the s3 tests' server (started by scripts/lib/s3rver.sh, in front of s3rver).

s3rver checks no SigV4 signature: a request signed with a wrong secret, or signing a header it does not send,
passes there and fails on AWS, MinIO or Ceph. This front recomputes every request's signature the way S3 does,
with botocore's signer (python3-botocore, Debian's; not the project's signer, which is libcurl's), and answers
what S3 answers when it does not match; only requests that verify are forwarded to s3rver (anonymously: s3rver
knows none of the front's keys and needs none).

    /usr/bin/python3 sigv4_front.py --upstream PORT --port-file FILE [--region us-east-1] [--key ID:SECRET]...

Listens on 127.0.0.1, port 0; writes its port to FILE once it accepts connections.

What it checks, as S3 does (the reply in parentheses):
  - an Authorization header "AWS4-HMAC-SHA256 Credential=ID/DATE/REGION/s3/aws4_request, SignedHeaders=...,
    Signature=..." (anonymous: 403 AccessDenied; another form: 400 AuthorizationHeaderMalformed)
  - a known, unrevoked access key id (403 InvalidAccessKeyId); the scope's region and service are the front's and
    its date is x-amz-date's (400 AuthorizationHeaderMalformed); x-amz-date within 15 minutes (403
    RequestTimeTooSkewed); x-amz-content-sha256 present (400 InvalidRequest)
  - host and every x-amz-* header sent are signed (403 AccessDenied "There were headers present in the request
    which were not signed"); every signed header is sent (403 SignatureDoesNotMatch naming it: what AWS's
    "'expect' is named as a SignedHeader, but it does not exist in the HTTP request" means)
  - the signature over the canonical request: method, the path and query as S3 re-encodes them (decoded, then
    RFC 3986 encoded: a client that signs another encoding than it sends fails), the signed headers' values,
    the payload hash (403 SignatureDoesNotMatch, with the canonical request and string to sign, as S3 sends)
  - a payload hash other than UNSIGNED-PAYLOAD is the body's SHA-256 (400 XAmzContentSHA256Mismatch)

Control requests (no Authorization header, path under /_front/; bucket names cannot start with '_'), for tests:
  PUT    /_front/keys/ID    body SECRET   adds the key pair ID/SECRET (200)
  DELETE /_front/keys/ID                  revokes ID: every later request signed with it is 403
                                          InvalidAccessKeyId, as AWS answers for a deleted key (200)
  GET    /_front/keys/ID                "verified N refused M": the requests signed with ID so far
  GET    /_front/stats                    "verified N refused M": all requests so far
  GET    /_front/signed-headers           one line per kind of verified request: "METHOD ?query,names
                                          SignedHeaders=... unsigned=...", the headers sent but not signed
                                          (scripts/s3-libcurl-check prints it: what each libcurl signs and sends)
A test that needs credentials to stop working mid-run adds its own key first and revokes that one (never the
shared S3RVER key: other suites use the server at the same time), e.g.
  curl -X PUT --data-binary SECRET $AWS_ENDPOINT_URL/_front/keys/CKPTKEY1; ...; curl -X DELETE .../CKPTKEY1
"""
import argparse
import datetime
import hashlib
import http.client
import http.server
import os
import re
import socket
import socketserver
import sys
import threading
import urllib.parse

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.compat import HTTPHeaders
from botocore.credentials import Credentials

HOP_BY_HOP = {'connection', 'keep-alive', 'proxy-connection', 'te', 'trailer', 'transfer-encoding', 'upgrade',
              'expect'}
AUTH_RE = re.compile(r'^AWS4-HMAC-SHA256 +Credential=([^,]+), *SignedHeaders=([^,]+), *Signature=([0-9a-f]{64})$')
MAX_SKEW = datetime.timedelta(minutes=15)
CHUNK = 1 << 20


class Refusal(Exception):
    def __init__(self, status, code, message, **extra):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra
        self.key_id = ''


class SignedHeadersOnly(S3SigV4Auth):
    """botocore's S3 signer over exactly the headers the client says it signed (botocore itself would pick
    its own set), so that the canonical request is the one S3 rebuilds from the request it received."""

    def __init__(self, credentials, region, signed):
        super().__init__(credentials, 's3', region)
        self._signed = signed

    def headers_to_sign(self, request):
        chosen = HTTPHeaders()
        for name in self._signed:
            for value in request.headers.get_all(name) or []:
                chosen[name] = value
        return chosen


class State:
    def __init__(self, keys, region, upstream):
        self.lock = threading.Lock()
        self.keys = dict(keys)  # access key id -> secret
        self.revoked = set()
        self.region = region
        self.upstream = upstream
        self.counts = {}  # access key id ('' before one is known) -> [verified, refused]
        self.shapes = set()  # (method, query names, signed headers, headers sent unsigned) of verified requests

    def secret_of(self, key_id):
        with self.lock:
            if key_id in self.revoked:
                return None
            return self.keys.get(key_id)

    def count(self, key_id, ok):
        with self.lock:
            self.counts.setdefault(key_id, [0, 0])[0 if ok else 1] += 1

    def note_shape(self, method, raw_query, headers):
        signed = AUTH_RE.match(headers.get('authorization', '').strip()).group(2)
        names = ','.join(sorted({p.split('=', 1)[0] for p in raw_query.split('&') if p})) or '-'
        unsigned = ','.join(sorted({n.lower() for n in headers.keys()} - set(signed.split(';')) - {'authorization'}))
        with self.lock:
            self.shapes.add(f'{method} ?{names} SignedHeaders={signed} unsigned={unsigned or "-"}')

    def counts_of(self, key_id=None):
        with self.lock:
            if key_id is not None:
                return self.counts.get(key_id, [0, 0])
            return [sum(c[0] for c in self.counts.values()), sum(c[1] for c in self.counts.values())]


def canonical_path(raw_path):
    # S3 decodes the path to the key and encodes it again (RFC 3986, '/' kept): the canonical URI.
    return urllib.parse.quote(urllib.parse.unquote(raw_path), safe='/~')


def query_pairs(raw_query):
    pairs = []
    for item in raw_query.split('&') if raw_query else []:
        name, _, value = item.partition('=')
        pairs.append((urllib.parse.unquote(name), urllib.parse.unquote(value)))
    return pairs


def verify(state, method, raw_path, raw_query, headers, body):
    """The access key id of a request signed as S3 requires; raises Refusal otherwise."""
    auth = headers.get('authorization')
    if auth is None:
        raise Refusal(403, 'AccessDenied', 'Access Denied (an anonymous request)')
    m = AUTH_RE.match(auth.strip())
    if not m:
        raise Refusal(400, 'AuthorizationHeaderMalformed', 'The authorization header is malformed')
    credential, signed_list, signature = m.groups()
    parts = credential.split('/')
    if len(parts) != 5 or parts[4] != 'aws4_request':
        raise Refusal(400, 'AuthorizationHeaderMalformed', 'The credential scope is malformed: ' + credential)
    key_id, day, region, service, _ = parts
    try:
        _check(state, method, raw_path, raw_query, headers, body, key_id, day, region, service, signed_list, signature)
    except Refusal as r:
        r.key_id = key_id
        raise
    return key_id


def _check(state, method, raw_path, raw_query, headers, body, key_id, day, region, service, signed_list, signature):
    secret = state.secret_of(key_id)
    if secret is None:
        raise Refusal(403, 'InvalidAccessKeyId', 'The AWS Access Key Id you provided does not exist in our records.',
                      AWSAccessKeyId=key_id)
    amz_date = headers.get('x-amz-date', '')
    try:
        when = datetime.datetime.strptime(amz_date, '%Y%m%dT%H%M%SZ')
    except ValueError:
        raise Refusal(403, 'AccessDenied', 'AWS authentication requires a valid x-amz-date header')
    if abs(datetime.datetime.utcnow() - when) > MAX_SKEW:
        raise Refusal(403, 'RequestTimeTooSkewed',
                      'The difference between the request time and the current time is too large.')
    if day != amz_date[:8] or region != state.region or service != 's3':
        raise Refusal(400, 'AuthorizationHeaderMalformed',
                      f"the credential scope {day}/{region}/{service} is not {amz_date[:8]}/{state.region}/s3",
                      Region=state.region)
    payload_hash = headers.get('x-amz-content-sha256')
    if payload_hash is None:
        raise Refusal(400, 'InvalidRequest', 'Missing required header for this request: x-amz-content-sha256')
    signed = signed_list.split(';')
    if signed != sorted(set(signed)) or any(n != n.lower() for n in signed):
        raise Refusal(403, 'SignatureDoesNotMatch', 'SignedHeaders is not a sorted list of lower-case names')
    sent = {name.lower() for name in headers.keys()}
    unsigned = sorted(n for n in sent if (n.startswith('x-amz-') or n == 'host') and n not in signed)
    if unsigned:
        raise Refusal(403, 'AccessDenied', 'There were headers present in the request which were not signed',
                      HeadersNotSigned=', '.join(unsigned))
    absent = [n for n in signed if n not in sent]
    if absent:
        raise Refusal(403, 'SignatureDoesNotMatch',
                      f"'{absent[0]}' is named as a SignedHeader, but it does not exist in the HTTP request")
    if payload_hash not in ('UNSIGNED-PAYLOAD',) and not payload_hash.startswith('STREAMING-'):
        if hashlib.sha256(body).hexdigest() != payload_hash:
            raise Refusal(400, 'XAmzContentSHA256Mismatch',
                          "The provided 'x-amz-content-sha256' header does not match what was computed.")

    request = AWSRequest(method=method, url='http://front' + canonical_path(raw_path), headers=HTTPHeaders(),
                         params=query_pairs(raw_query))
    for name in signed:
        for value in headers.get_all(name) or []:
            request.headers[name] = value
    request.context['timestamp'] = amz_date
    signer = SignedHeadersOnly(Credentials(key_id, secret, headers.get('x-amz-security-token')), region, signed)
    canonical = signer.canonical_request(request)
    string_to_sign = signer.string_to_sign(request, canonical)
    if signer.signature(string_to_sign, request) != signature:
        raise Refusal(403, 'SignatureDoesNotMatch',
                      'The request signature we calculated does not match the signature you provided. '
                      'Check your key and signing method.',
                      AWSAccessKeyId=key_id, StringToSign=string_to_sign, CanonicalRequest=canonical)


def xml_escape(s):
    return str(s).replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    server_version = 'shardkit-sigv4-front'

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args):
        pass

    def _read_body(self):
        if 'chunked' in self.headers.get('transfer-encoding', '').lower():
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b';')[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b'\r\n', b'\n', b''):
                        pass
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get('content-length') or 0))

    def _reply(self, status, body=b'', content_type='application/xml'):
        self.send_response(status)
        self.send_header('Content-Type', content_type)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        if self.command != 'HEAD':
            self.wfile.write(body)

    def _refuse(self, r):
        self.server.state.count(r.key_id, False)
        fields = ''.join(f'<{k}>{xml_escape(v)}</{k}>' for k, v in r.extra.items())
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>' + r.code + '</Code><Message>' +
                xml_escape(r.message) + '</Message>' + fields + '</Error>').encode()
        self._reply(r.status, body)

    def _control(self, body):
        state = self.server.state
        path = urllib.parse.unquote(self.path.split('?')[0])
        if path.startswith('/_front/keys/') and self.command == 'GET':
            verified, refused = state.counts_of(path[len('/_front/keys/'):])
            return self._reply(200, f'verified {verified} refused {refused}'.encode(), 'text/plain')
        if path.startswith('/_front/keys/') and self.command in ('PUT', 'DELETE'):
            key_id = path[len('/_front/keys/'):]
            with state.lock:
                if self.command == 'PUT':
                    state.keys[key_id] = body.decode()
                    state.revoked.discard(key_id)
                else:
                    state.revoked.add(key_id)
            return self._reply(200, b'', 'text/plain')
        if path == '/_front/signed-headers' and self.command == 'GET':
            with state.lock:
                text = ''.join(line + '\n' for line in sorted(state.shapes))
            return self._reply(200, text.encode(), 'text/plain')
        if path == '/_front/stats' and self.command == 'GET':
            verified, refused = state.counts_of()
            return self._reply(200, f'verified {verified} refused {refused}'.encode(), 'text/plain')
        self._reply(404, b'no such control request', 'text/plain')

    def _upstream(self):
        conn = getattr(self, 'upstream_connection', None)
        if conn is None:
            conn = self.upstream_connection = http.client.HTTPConnection('127.0.0.1', self.server.state.upstream)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _forward(self, body):
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != 'authorization'}
        headers['Content-Length'] = str(len(body))
        for attempt in (1, 2):  # a kept-alive upstream connection s3rver closed meanwhile: once more on a new one
            conn = self._upstream()
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                break
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                self.upstream_connection = None
                if attempt == 2:
                    raise
        self.send_response_only(response.status, response.reason)
        length = response.getheader('content-length')
        for k, v in response.getheaders():
            if k.lower() not in HOP_BY_HOP and k.lower() != 'content-length':
                self.send_header(k, v)
        content_range = response.getheader('content-range') or ''
        if self.command == 'HEAD' or response.status in (204, 304):
            if length is not None:
                self.send_header('Content-Length', length)
            self.end_headers()
            response.read()
        elif content_range.endswith('/0'):
            # s3rver's range of an empty object: "206, Content-Range: bytes 0-0/0, Content-Length: 1" and a byte
            # that never comes. Relayed as it is (the sink stops at that header), then both connections end.
            self.send_header('Content-Length', length or '0')
            self.end_headers()
            self.wfile.flush()
            conn.close()
            self.upstream_connection = None
            self.close_connection = True
            return
        elif length is not None:
            self.send_header('Content-Length', length)
            self.end_headers()
            while True:
                chunk = response.read(CHUNK)
                if not chunk:
                    break
                self.wfile.write(chunk)
        else:
            data = response.read()
            self.send_header('Content-Length', str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        if response.will_close:
            conn.close()
            self.upstream_connection = None

    def _handle(self):
        body = self._read_body()
        raw_path, _, raw_query = self.path.partition('?')
        if 'authorization' not in self.headers and raw_path.startswith('/_front/'):
            return self._control(body)
        try:
            key_id = verify(self.server.state, self.command, raw_path, raw_query, self.headers, body)
        except Refusal as r:
            return self._refuse(r)
        self.server.state.count(key_id, True)
        self.server.state.note_shape(self.command, raw_query, self.headers)
        self._forward(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--upstream', type=int, required=True)
    p.add_argument('--port-file', required=True)
    p.add_argument('--region', default='us-east-1')
    p.add_argument('--key', action='append', default=[], help='ID:SECRET')
    a = p.parse_args()
    server = Server(('127.0.0.1', 0), Handler)
    server.state = State((k.split(':', 1) for k in a.key), a.region, a.upstream)
    with open(a.port_file + '.tmp', 'w') as f:
        f.write(str(server.server_address[1]))
    os.replace(a.port_file + '.tmp', a.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == '__main__':
    sys.exit(main())
