#!/usr/bin/env bash
# Make a private CA and the three certificates etcd and its clients need, then (with --apply)
# store them as the Secrets the manifests mount. Good for a first deployment; in production use
# cert-manager (same Secret layout: tls.crt, tls.key, ca.crt) so certificates rotate.
#
#   deploy/k8s/etcd/make-certs.sh NAMESPACE OUTDIR [--apply]
#
# The private keys stay in OUTDIR (created mode 0700) and in the Secrets: never commit OUTDIR.
set -euo pipefail

namespace=${1:?usage: make-certs.sh NAMESPACE OUTDIR [--apply]}
outdir=${2:?usage: make-certs.sh NAMESPACE OUTDIR [--apply]}
apply=${3:-}
days=${CERT_DAYS:-825}

umask 077
mkdir -p "$outdir"
cd "$outdir"

openssl req -x509 -newkey rsa:4096 -nodes -sha256 -days "$days" \
  -subj "/CN=elastic-ddp-etcd-ca" -keyout ca.key -out ca.crt

# issue NAME CN EXTENDED_KEY_USAGE SUBJECT_ALT_NAMES
issue() {
  local name=$1 cn=$2 usage=$3 sans=$4
  openssl req -newkey rsa:2048 -nodes -sha256 -subj "/CN=$cn" -keyout "$name.key" -out "$name.csr"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=%s\n%s' \
    "$usage" "${sans:+subjectAltName=$sans}" >"$name.ext"
  openssl x509 -req -sha256 -days "$days" -in "$name.csr" -CA ca.crt -CAkey ca.key \
    -CAcreateserial -extfile "$name.ext" -out "$name.crt"
  rm -f "$name.csr" "$name.ext"
}

members="DNS:*.etcd.$namespace.svc,DNS:*.etcd.$namespace.svc.cluster.local"
clients="DNS:etcd-client,DNS:etcd-client.$namespace,DNS:etcd-client.$namespace.svc"
clients="$clients,DNS:etcd-client.$namespace.svc.cluster.local,DNS:localhost,IP:127.0.0.1"

# What clients connect to (the client Service or one member) must be in the server certificate.
issue server etcd-server serverAuth,clientAuth "$members,$clients"
issue peer etcd-peer serverAuth,clientAuth "$members"
# With etcd auth enabled and no password, etcd would take the user from this CN; elastic_ddp
# sends user + password (rdzv_conf user=..., env ELASTIC_DDP_ETCD_PASSWORD) as well.
issue client elastic-ddp clientAuth ""

if [[ $apply == --apply ]]; then
  for name in server peer client; do
    kubectl -n "$namespace" create secret generic "etcd-$name-tls" --type=kubernetes.io/tls \
      --from-file=tls.crt="$name.crt" --from-file=tls.key="$name.key" --from-file=ca.crt=ca.crt \
      --dry-run=client -o yaml | kubectl apply -f -
  done
fi
echo "Certificates in $outdir (keep ca.key offline)."
