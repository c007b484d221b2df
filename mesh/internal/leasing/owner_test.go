package leasing

import (
	"errors"
	"fmt"
	"testing"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
)

// TestOwnerRequest: a holder's request names a key of the policy, and
// becomes the owner core's operation in the owner's epoch.
func TestOwnerRequest(t *testing.T) {
	for key, want := range map[string]bool{
		"p.acme": true, "p.acme.tenant=a": true, "p.acmex": false, "p.acm": false, "p.other.tenant=a": false, "acme": false,
	} {
		if got := policyKey(acme, key); got != want {
			t.Errorf("policyKey(acme, %q) = %v, want %v", key, got, want)
		}
	}
	if policyKey(nil, "p.acme") {
		t.Error("a key of no policy in force")
	}
	acq := leaseOpOf(ownerRequest{Op: opAcquire, Holder: "eu-1", Want: 10 * u, Min: u, Grant: 9}, 41)
	if acq.Epoch != 41 || acq.Report != nil || *acq.Acquire != (lease.AcquireReq{Holder: "eu-1", Want: 10 * u, Min: u}) {
		t.Errorf("acquire: %+v %+v", acq, acq.Acquire)
	}
	for _, op := range []string{opReport, opReturn} {
		rep := leaseOpOf(ownerRequest{Op: op, Grant: 7, Epoch: 40, Spent: 3 * u}, 41)
		want := lease.ReportReq{ID: 7, Epoch: 40, Spent: 3 * u, Return: op == opReturn}
		if rep.Epoch != 41 || rep.Acquire != nil || *rep.Report != want {
			t.Errorf("%s: %+v %+v", op, rep, rep.Report)
		}
	}
}

// TestOwnerReply: what the owner core decided becomes the holder's reply.
// A grant's ttl is its life on the owner's clock (Expires − At), which
// the holder counts from its own instant of asking (L4).
func TestOwnerReply(t *testing.T) {
	out := keyrec.Decision{Policy: "acme", Revision: 3}
	grant := keyrec.Grant{ID: 7, Epoch: 41, Holder: "eu-1", Units: 10 * u, At: 5_000 * ms, Expires: 7_000 * ms}
	acquire := func(r lease.AcquireResult, refused error) *keys.LeaseOp {
		return &keys.LeaseOp{Acquire: &lease.AcquireReq{}, Acquired: r, Refused: refused}
	}
	report := func(refunded int64, refused error) *keys.LeaseOp {
		return &keys.LeaseOp{Report: &lease.ReportReq{}, Refunded: refunded, Refused: refused}
	}
	for _, c := range []struct {
		name string
		err  error
		op   *keys.LeaseOp
		want reply
	}{
		{"granted", nil, acquire(lease.AcquireResult{Outcome: lease.Granted, Grant: grant, Remaining: 30 * u}, nil),
			reply{Result: resGranted, Policy: "acme", Revision: 3, Grant: 7, Epoch: 41, Units: 10 * u, TTL: 2_000 * ms, Remaining: 30 * u}},
		{"exhausted", nil, acquire(lease.AcquireResult{Outcome: lease.Exhausted, RetryAfter: 300 * ms}, nil),
			reply{Result: resExhausted, Policy: "acme", Revision: 3, RetryAfter: 300 * ms}},
		{"full", nil, acquire(lease.AcquireResult{Outcome: lease.Full, RetryAfter: 100 * ms, Remaining: 2 * u}, nil),
			reply{Result: resFull, Policy: "acme", Revision: 3, RetryAfter: 100 * ms, Remaining: 2 * u}},
		{"not leased any more", nil, acquire(lease.AcquireResult{}, keys.ErrNotLeased),
			reply{Result: resNotLeased, Policy: "acme", Revision: 3}},
		{"report", nil, report(0, nil), reply{Result: resOK, Policy: "acme", Revision: 3}},
		{"return", nil, report(4*u, nil), reply{Result: resOK, Policy: "acme", Revision: 3, Refunded: 4 * u}},
		{"stale epoch", nil, report(0, lease.ErrStaleEpoch), reply{Result: resStale, Policy: "acme", Revision: 3}},
		{"bad spend", nil, report(0, fmt.Errorf("x: %w", lease.ErrBadSpend)), reply{Result: resBadSpend, Policy: "acme", Revision: 3}},
		{"unknown grant", nil, report(0, lease.ErrUnknownGrant), reply{Result: resUnknown, Policy: "acme", Revision: 3}},
		{"fenced", fmt.Errorf("write: %w", fail.ErrFenced), acquire(lease.AcquireResult{}, nil), reply{Result: resNotOwner}},
		{"write failed", errors.New("timeout"), report(0, nil), reply{Result: resUnavail, Message: "timeout"}},
	} {
		got := ownerReply(&keys.Call{Out: out, Err: c.err}, c.op)
		if got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
}
