package auth

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go"
)

// claimsUpdateSubject is where the system account's users push account
// JWTs to the servers' resolvers.
const claimsUpdateSubject = "$SYS.REQ.CLAIMS.UPDATE"

// claimsUpdateReply is a server's answer to a pushed account JWT.
type claimsUpdateReply struct {
	Data *struct {
		Account string `json:"account"`
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"data"`
	Error *struct {
		Account     string `json:"account"`
		Code        int    `json:"code"`
		Description string `json:"description"`
	} `json:"error"`
}

// PushAccount gives a running deployment the account JWT accountJWT: nc is
// a connection of a system account user (the deployment's sys.creds). The
// servers' resolvers store it and apply it at once; a stored JWT survives
// their restarts. The first server's answer counts; a refusal wraps
// [ErrPush].
func PushAccount(ctx context.Context, nc *nats.Conn, accountJWT string) error {
	msg, err := nc.RequestWithContext(ctx, claimsUpdateSubject, []byte(accountJWT))
	if err != nil {
		return fmt.Errorf("auth: push account: %w", err)
	}
	var r claimsUpdateReply
	if err := json.Unmarshal(msg.Data, &r); err != nil {
		return fmt.Errorf("%w: unreadable answer %q", ErrPush, msg.Data)
	}
	switch {
	case r.Error != nil:
		return fmt.Errorf("%w: %s (code %d)", ErrPush, r.Error.Description, r.Error.Code)
	case r.Data == nil:
		return fmt.Errorf("%w: empty answer %q", ErrPush, msg.Data)
	}
	return nil
}
