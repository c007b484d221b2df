package auth

import "errors"

// ErrForbidden is returned, wrapped with the reason, by [Binder.Caller] and
// [BindTenant] when a request may not be decided as it stands: a tenant
// account's descriptor names another tenant, or the caller's identity
// cannot be established (an unreadable or repeated Nats-Request-Info
// header, an account whose JWT is not signed by a trusted operator key or
// whose name is not a tenant name). The node answers it with 403
// `forbidden` (CONTRACT.md §9).
var ErrForbidden = errors.New("auth: forbidden")

// ErrLookup is returned, wrapped with the cause, by [Binder.Caller] when the calling account's JWT could not be fetched
// (timeout, no resolver answer). Trying again later may succeed; the node
// answers it as unavailable (503).
var ErrLookup = errors.New("auth: account lookup failed")

// ErrBadRequestInfo is returned, wrapped with the defect, by
// [RequestInfoAccount] for a Nats-Request-Info value that is not a JSON
// object with exactly one string field "acc".
var ErrBadRequestInfo = errors.New("auth: malformed Nats-Request-Info")

// ErrInvalidName is returned, wrapped with the name, for a tenant name that
// does not match [TenantNamePattern].
var ErrInvalidName = errors.New("auth: invalid tenant name")

// ErrExists is returned by [Init] for a directory that already holds files
// (unless [InitOptions.Force]) and by [AddTenant] for a tenant the
// deployment already has.
var ErrExists = errors.New("auth: already exists")

// ErrDeployment is returned, wrapped with the file and the defect, by
// [Load] and [AddTenant] when a deployment directory is missing a file or
// holds one that does not decode or does not fit the rest.
var ErrDeployment = errors.New("auth: invalid deployment directory")

// ErrPush is returned, wrapped with the server's answer, by [PushAccount]
// when the server did not accept an account JWT.
var ErrPush = errors.New("auth: account update refused")
