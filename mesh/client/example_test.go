package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"time"

	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/nats-io/nats.go"
)

func ExampleClient_Decide() {
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	c, err := client.New(nc, client.OnUnavailable(func(policy string, d map[string]string) client.Failure {
		if policy == "acme-search" {
			return client.FailOpenBucket(10, 40)
		}
		return client.FailClosed()
	}))
	if err != nil {
		log.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	res, err := c.Decide(ctx, map[string]string{"tenant": "acme", "operation": "search", "plan": "v7"}, 3,
		client.RequestID("7f1c2e"))
	switch {
	case errors.Is(err, client.ErrInvalidRequest):
		log.Printf("bad descriptor: %v", err)
	case err != nil:
		log.Printf("no decision: %v", err)
	case !res.Allowed && res.Never:
		fmt.Println("cost above the limit's capacity")
	case !res.Allowed:
		fmt.Printf("denied by %s (revision %d), retry after %v\n", res.Policy, res.Revision, res.RetryAfter)
	default:
		fmt.Printf("admitted, %s left (source %v)\n", res.Remaining, res.Source)
	}
}

func ExampleMiddleware() {
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	c, err := client.New(nc, client.OnUnavailable(func(string, map[string]string) client.Failure {
		return client.FailOpenBucket(5, 10)
	}))
	if err != nil {
		log.Fatal(err)
	}
	search := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "results")
	})
	limited := client.Middleware(c, func(r *http.Request) (client.Request, bool) {
		tenant := r.Header.Get("X-Tenant")
		if tenant == "" {
			return client.Request{}, false // not limited
		}
		return client.Request{Descriptor: map[string]string{"tenant": tenant, "operation": "search"}, Cost: 1}, true
	}, search, client.PolicyQuotas(func(policy string) (client.Quota, bool) {
		if policy == "acme-search" {
			return client.Quota{Quota: 40, Window: 4 * time.Second}, true
		}
		return client.Quota{}, false
	}))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", limited))
}

func ExampleClient_Reserve() {
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	c, err := client.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	// Reserve the most an export may cost, run it, then settle what it cost.
	r, err := c.Reserve(ctx, map[string]string{"tenant": "acme", "operation": "export"}, 100, time.Minute,
		client.RequestID("export-7f1c2e"))
	switch {
	case err != nil:
		log.Printf("no answer: %v", err)
	case !r.Allowed:
		fmt.Printf("denied by %s, retry after %v\n", r.Policy, r.RetryAfter)
	default:
		rows := int64(37) // the export's true cost
		st, err := c.Settle(ctx, r.ID, rows)
		if errors.Is(err, client.ErrNotFound) {
			log.Print("the reservation expired: it counted at its reserved cost")
		} else if err == nil {
			fmt.Printf("settled %s, %s given back\n", st.Settled, st.Returned)
		}
	}
}

func ExampleConcurrencyMiddleware() {
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	c, err := client.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	report := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "a slow report")
	})
	// At most the policy's concurrency limit of reports in flight per
	// tenant; a request beyond it gets 429.
	limited := client.ConcurrencyMiddleware(c, func(r *http.Request) (client.Request, bool) {
		return client.Request{Descriptor: map[string]string{"tenant": r.Header.Get("X-Tenant"), "operation": "report"}}, true
	}, report, client.SlotTTL(30*time.Second))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", limited))
}

func ExampleMeter() {
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	c, err := client.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	m, err := client.NewMeter(c, map[string]string{"tenant": "acme", "operation": "completion"}, 500, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		if err := m.Close(ctx); err != nil {
			log.Printf("settling: %v", err)
		}
	}()
	for _, token := range []string{"Rate", " limits", " protect", " everyone"} {
		if err := m.Add(ctx, 1); err != nil {
			var denied *client.ChunkDeniedError
			if errors.As(err, &denied) {
				fmt.Printf("budget exhausted (policy %s): stream stopped\n", denied.Result.Policy)
			}
			return
		}
		fmt.Print(token)
	}
}
