package client

import (
	"context"
	"encoding/json"
	"fmt"
)

// Item is one descriptor of a DecideAll request.
type Item struct {
	Descriptor map[string]string
	Cost       int64 // whole units (>= 1)
	DryRun     bool  // read only: never spends, but its denial denies the request
}

// DecideAll decides several descriptors at once, all or nothing (CONTRACT
// §11, the node's decide_all endpoint: "<prefix>.v1.decide.all"): allowed
// is true when every item is admitted by every layer it meets, and then
// each spent in all of them; otherwise none spent anywhere. It returns one
// Result per item, in order. There is no failure behaviour: when no
// decision can be had it returns the unavailability error (ErrTimeout,
// ErrNoResponders, ErrUnavailable), as Reserve does. It does not use
// leases.
func (c *Client) DecideAll(ctx context.Context, items []Item) (allowed bool, results []*Result, err error) {
	if len(items) == 0 {
		return false, nil, fmt.Errorf("%w: no items", ErrInvalidRequest)
	}
	body := append(make([]byte, 0, 64*len(items)), `{"descriptors":[`...)
	for i, it := range items {
		o := decideOptions{dryRun: it.DryRun}
		if _, err := checkRequest(it.Descriptor, it.Cost, &o); err != nil {
			return false, nil, fmt.Errorf("item %d: %w", i, err)
		}
		if i > 0 {
			body = append(body, ',')
		}
		body = appendRequest(body, it.Descriptor, it.Cost, &o)
	}
	body = append(body, "]}"...)
	rctx := ctx
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(ctx, c.opts.timeout)
		defer cancel()
	}
	msg, err := c.nc.RequestWithContext(rctx, c.opts.prefix+".v1.decide.all", body)
	if err != nil {
		return false, nil, c.mapError(ctx, err)
	}
	if code, desc := msg.Header.Get(headerErrorCode), msg.Header.Get(headerError); code != "" || desc != "" {
		return false, nil, decodeServiceError(code, desc, msg.Data)
	}
	var w struct {
		Allowed *bool       `json:"allowed"`
		Results []wireReply `json:"results"`
	}
	if err := json.Unmarshal(msg.Data, &w); err != nil {
		return false, nil, fmt.Errorf("%w: %w", ErrBadReply, err)
	}
	if w.Allowed == nil || len(w.Results) != len(items) {
		return false, nil, fmt.Errorf("%w: %d results for %d items", ErrBadReply, len(w.Results), len(items))
	}
	results = make([]*Result, len(items))
	for i := range w.Results {
		if results[i], err = resultOf(&w.Results[i]); err != nil {
			return false, nil, err
		}
	}
	return *w.Allowed, results, nil
}
