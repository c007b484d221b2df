#!/bin/sh
# Puts every policy of deploy/envoy/policies into the policy bucket with the
# nats CLI: the key is the file name without .json. Arguments go to nats,
# e.g.
#
#   deploy/envoy/put-policies.sh --server nats://127.0.0.1:4222
#   deploy/envoy/put-policies.sh --creds ./secure/admin.creds
#
# LIMITMESH_PREFIX names the installation's prefix (default rl: bucket
# rl_policies). `limitmesh policy put NAME FILE` does the same one policy at
# a time and checks it with the node's parser first.
set -eu
dir=$(dirname "$0")/policies
bucket=${LIMITMESH_PREFIX:-rl}_policies
for f in "$dir"/*.json; do
	name=$(basename "$f" .json)
	nats "$@" kv put "$bucket" "$name" "$(cat "$f")" >/dev/null
	echo "put $bucket $name"
done
