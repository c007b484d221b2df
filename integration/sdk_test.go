package integration

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
)

// TestSDKAgainstNode drives the Go SDK against a real node: typed results,
// an invalid request, then the failure behaviours once the node is stopped.
func TestSDKAgainstNode(t *testing.T) {
	e := server(t, t.TempDir())
	frozen := time.Now()
	nodeConn := connect(t, e)
	n, err := mesh.NewNode(nodeConn, mesh.NodeConfig{Clock: func() time.Time { return frozen }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := n.Start(ctx); err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			n.Stop(context.Background())
		}
	}()
	rev := putPolicy(t, nodeConn, "rl_policies", "acme-search", acmePolicy)
	waitRevision(t, nodeConn, acmeDesc, rev)

	gw := connect(t, e)
	failClosed, err := client.New(gw, client.Timeout(200*time.Millisecond),
		client.OnUnavailable(func(string, map[string]string) client.Failure { return client.FailClosed() }))
	if err != nil {
		t.Fatal(err)
	}
	emergencyNow := frozen
	emergency, err := client.New(gw, client.Timeout(200*time.Millisecond),
		client.Clock(func() time.Time { return emergencyNow }),
		client.OnUnavailable(func(policy string, _ map[string]string) client.Failure {
			if policy != "acme-search" {
				return client.FailClosed()
			}
			return client.FailOpenBucket(2, 3) // 2/s, burst 3
		}))
	if err != nil {
		t.Fatal(err)
	}
	plain, err := client.New(gw, client.Timeout(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}

	// The service decides: a typed result naming the policy and revision.
	res, err := failClosed.Decide(ctx, acmeDesc, 38)
	if err != nil || !res.Allowed || res.Policy != "acme-search" || res.Revision != rev || res.Source != client.SourceService {
		t.Fatalf("decide 38: %+v, %v", res, err)
	}
	if m, ok := res.Remaining.Micro(); !ok || m != 2_000_000 {
		t.Fatalf("remaining %q, want 2", res.Remaining)
	}
	// The emergency client learns the descriptor's policy from this answer.
	if res, err = emergency.Decide(ctx, acmeDesc, 1); err != nil || !res.Allowed {
		t.Fatalf("decide 1: %+v, %v", res, err)
	}
	res, err = failClosed.Decide(ctx, acmeDesc, 2)
	if err != nil || res.Allowed || res.RetryAfter != 100*time.Millisecond || res.Never {
		t.Fatalf("over the burst: %+v, %v; want a denial retrying after 100ms", res, err)
	}
	if res, err = failClosed.Decide(ctx, acmeDesc, 41); err != nil || res.Allowed || !res.Never {
		t.Fatalf("cost above burst: %+v, %v; want never", res, err)
	}
	// A descriptor lacking a key dimension is an invalid request, never
	// masked by the failure behaviour.
	_, err = failClosed.Decide(ctx, map[string]string{"tenant": "acme", "operation": "search"}, 1)
	var se *client.ServiceError
	if !errors.Is(err, client.ErrInvalidRequest) || !errors.As(err, &se) || se.Code != 400 {
		t.Fatalf("missing dimension: %v, want a 400 ErrInvalidRequest", err)
	}

	// The node stops: no responders.
	if err := n.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	stopped = true
	if _, err := plain.Decide(ctx, acmeDesc, 1); !errors.Is(err, client.ErrNoResponders) || !client.IsUnavailable(err) {
		t.Fatalf("without a failure behaviour: %v, want ErrNoResponders", err)
	}
	res, err = failClosed.Decide(ctx, acmeDesc, 1)
	if err != nil || res.Allowed || res.Source != client.SourceFailClosed || !errors.Is(res.Err, client.ErrNoResponders) {
		t.Fatalf("fail closed: %+v, %v", res, err)
	}
	// The emergency bucket is bounded: exactly its burst, then its rate.
	admitted := 0
	for range 10 {
		res, err := emergency.Decide(ctx, acmeDesc, 1)
		if err != nil || res.Source != client.SourceEmergency {
			t.Fatalf("emergency: %+v, %v", res, err)
		}
		if res.Allowed {
			admitted++
		}
	}
	if admitted != 3 {
		t.Fatalf("emergency bucket admitted %d of 10, want its burst of 3", admitted)
	}
	emergencyNow = emergencyNow.Add(time.Second) // 2 more at 2/s
	admitted = 0
	for range 10 {
		if res, _ := emergency.Decide(ctx, acmeDesc, 1); res != nil && res.Allowed {
			admitted++
		}
	}
	if admitted != 2 {
		t.Fatalf("after 1s the emergency bucket admitted %d, want 2", admitted)
	}
}

// TestMiddlewareAgainstNode: denials from a real node become 429 with
// Retry-After, RateLimit headers and no-store.
func TestMiddlewareAgainstNode(t *testing.T) {
	e := server(t, t.TempDir())
	frozen := time.Now()
	tn := startNode(t, e, mesh.NodeConfig{Clock: func() time.Time { return frozen }})
	rev := putPolicy(t, tn.nc, "rl_policies", "acme-search", acmePolicy)
	waitRevision(t, tn.nc, acmeDesc, rev)
	c, err := client.New(connect(t, e))
	if err != nil {
		t.Fatal(err)
	}
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("results")) })
	h := client.Middleware(c, func(r *http.Request) (client.Request, bool) {
		return client.Request{Descriptor: map[string]string{
			"tenant": r.Header.Get("X-Tenant"), "operation": "search", "plan": "v7"}, Cost: 20}, true
	}, ok, client.PolicyQuotas(func(string) (client.Quota, bool) {
		return client.Quota{Quota: 40, Window: 4 * time.Second}, true
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()

	get := func() *http.Response {
		req, _ := http.NewRequest("GET", srv.URL+"/search", nil)
		req.Header.Set("X-Tenant", "acme")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	for i := range 2 {
		if resp := get(); resp.StatusCode != 200 || resp.Header.Get("RateLimit") == "" {
			t.Fatalf("request %d: %d, RateLimit %q", i, resp.StatusCode, resp.Header.Get("RateLimit"))
		}
	}
	resp := get()
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("third request of 20 units: %d, want 429", resp.StatusCode)
	}
	// 20 units at 10/s: 2 s, whole seconds rounded up.
	for h, want := range map[string]string{
		"Retry-After":      "2",
		"Cache-Control":    "no-store, private",
		"RateLimit":        `"acme-search";r=0;t=4`,
		"RateLimit-Policy": `"acme-search";q=40;w=4`,
	} {
		if got := resp.Header.Get(h); got != want {
			t.Errorf("%s = %q, want %q", h, got, want)
		}
	}
}
