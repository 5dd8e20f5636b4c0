// The S3 server of the `s3` tests: s3rver (pinned by scripts/lib/s3rver.sh) on loopback with the test bucket, plus
// the two multipart calls s3rver 3.7.1 lacks, so that the tests can show an aborted upload leaves nothing:
// AbortMultipartUpload (DELETE /bucket/key?uploadId=), ListMultipartUploads (GET /bucket?uploads, with each upload's
// Initiated: its key file's time) and ListParts (GET /bucket/key?uploadId=, each part's LastModified and Size).
//
//   node --openssl-legacy-provider s3rver_server.js <s3rver module dir> <data dir> <port file> <bucket>...
//
// (--openssl-legacy-provider: s3rver makes ListObjectsV2 continuation tokens with DES, which OpenSSL 3 retired.)
// Listens on 127.0.0.1 (SHARDKIT_S3RVER_ADDRESS: another local address, e.g. a lab host's for scripts/governor-lab),
// port 0; writes the port to <port file> once it accepts connections. Virtual-hosted
// requests work with the endpoint http://s3.localhost:<port> (bucket.s3.localhost).
'use strict';
const fs = require('fs');
const path = require('path');

const [moduleDir, dataDir, portFile, ...buckets] = process.argv.slice(2);
const S3rver = require(moduleDir);

const xml = s => String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
const uploadsDir = bucket => path.join(dataDir, bucket, '._S3rver_uploads');

function noSuchUpload(ctx) {
  ctx.status = 404;
  ctx.type = 'application/xml';
  ctx.body = '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code>' +
             '<Message>The specified upload does not exist.</Message></Error>';
}

function multipartExtras(ctx, next) {
  const parts = ctx.path.split('/').filter(p => p.length);
  const bucket = decodeURIComponent(parts[0] || '');
  if (ctx.method === 'DELETE' && parts.length > 1 && 'uploadId' in ctx.query) {
    const dir = path.join(uploadsDir(bucket), path.basename(ctx.query.uploadId));
    if (!fs.existsSync(dir)) return noSuchUpload(ctx);
    fs.rmSync(dir, { recursive: true, force: true });
    ctx.status = 204;
    return;
  }
  if (ctx.method === 'GET' && parts.length === 1 && 'uploads' in ctx.query) {
    const prefix = ctx.query.prefix || '';
    let uploads = [];
    if (fs.existsSync(uploadsDir(bucket))) {
      for (const id of fs.readdirSync(uploadsDir(bucket))) {
        const keyFile = path.join(uploadsDir(bucket), id, 'key');
        if (!fs.existsSync(keyFile)) continue;
        const key = fs.readFileSync(keyFile, 'utf8');
        if (key.startsWith(prefix)) uploads.push({ key, id, initiated: fs.statSync(keyFile).mtime.toISOString() });
      }
    }
    uploads.sort((a, b) => (a.key < b.key ? -1 : a.key > b.key ? 1 : 0));
    ctx.type = 'application/xml';
    ctx.body = '<?xml version="1.0" encoding="UTF-8"?>\n<ListMultipartUploadsResult><Bucket>' + xml(bucket) +
               '</Bucket><Prefix>' + xml(prefix) + '</Prefix><IsTruncated>false</IsTruncated>' +
               uploads.map(u => '<Upload><Key>' + xml(u.key) + '</Key><UploadId>' + xml(u.id) + '</UploadId><Initiated>' +
                                   u.initiated + '</Initiated></Upload>').join('') +
               '</ListMultipartUploadsResult>';
    return;
  }
  if (ctx.method === 'GET' && parts.length > 1 && 'uploadId' in ctx.query) {  // ListParts (one page: all parts)
    const dir = path.join(uploadsDir(bucket), path.basename(ctx.query.uploadId));
    if (!fs.existsSync(dir)) return noSuchUpload(ctx);
    const numbers = fs.readdirSync(dir).filter(f => /^[0-9]+$/.test(f)).map(Number).sort((a, b) => a - b);
    ctx.type = 'application/xml';
    ctx.body = '<?xml version="1.0" encoding="UTF-8"?>\n<ListPartsResult><Bucket>' + xml(bucket) + '</Bucket><UploadId>' +
               xml(ctx.query.uploadId) + '</UploadId><IsTruncated>false</IsTruncated>' +
               numbers.map(n => {
                 const st = fs.statSync(path.join(dir, String(n)));
                 return '<Part><PartNumber>' + n + '</PartNumber><LastModified>' + st.mtime.toISOString() +
                        '</LastModified><Size>' + st.size + '</Size></Part>';
               }).join('') + '</ListPartsResult>';
    return;
  }
  return next();
}

// An UploadPart still being written when its upload is aborted (the tests abort uploads on purpose) fails inside
// s3rver with ENOENT on the part's file, from a stream whose error nobody handles, and that would end the process
// and every later suite's requests. The upload is gone anyway: say so and keep serving.
process.on('uncaughtException', e => console.error('s3rver: ignored:', e && e.message));
process.on('unhandledRejection', e => console.error('s3rver: ignored:', e && e.message));

const server = new S3rver({
  address: process.env.SHARDKIT_S3RVER_ADDRESS || '127.0.0.1',
  port: 0,
  silent: true,
  directory: dataDir,
  serviceEndpoint: 'localhost',
  configureBuckets: buckets.map(name => ({ name })),
});
// After s3rver's own middleware has mapped a virtual-hosted request onto /bucket/key, before its router.
server.middleware.splice(server.middleware.length - 1, 0, multipartExtras);
server.run().then(
  address => fs.writeFileSync(portFile, String(address.port)),
  error => {
    console.error('s3rver failed to start:', error);
    process.exit(1);
  });
