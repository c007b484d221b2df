package service

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// Layers (CONTRACT §11, docs/protocol.md "Layers"). A request that meets
// policies in several layers is admitted only if every layer's policy
// admits it, and then spends in all of them; when one denies, it spends in
// none. The node that received it coordinates, in two steps:
//
//  1. Hold. It asks the owner of each layer's key (itself or another node,
//     routed as a reservation) to hold the cost: a reservation of the
//     layer's policy (keys.ResOp.Hold) that lasts HoldTTL at most. All
//     holds are asked at once.
//  2. Commit or release. When every layer held, it answers admitted and
//     commits the holds (settles them whole: the layers' admissions). When
//     a layer denied, it releases the holds made (the units come back as
//     if never taken) and answers denied once the releases are written.
//
// A hold that is neither committed nor released (a coordinator that died,
// a commit lost) expires after HoldTTL as spent: "presumed commit". So no
// layer ever admits beyond its limits (every unit spent was held first),
// an admitted request's spend is in every layer, and a denied request's
// spend is in no layer once its releases are acknowledged; if they cannot
// be (a layer's owner unreachable), the answer is 503 and those holds end
// as spent within HoldTTL. While a decision is under way its cost is held
// in the layers that admitted it: at most the request's cost per layer,
// for at most the decision timeout (then HoldTTL if the coordinator died).
// These are invariants A1-A4 of docs/protocol.md: a hold is a strict
// admission by the layer's owner (A1); admitted means held everywhere and
// committed or presumed committed (A2); denied means every hold released
// before the answer (A3); holds bounded in cost and time (A4).
//
// Local-mode layers are decided by the coordinator itself after the holds
// (they cannot be held); a local layer that denies makes the request
// denied and the holds released, but a local layer decided before it keeps
// its spend (within local mode's own bound).

// holdTTL is how long a layer's hold lasts unless committed or released:
// twice the decision timeout.
func (s *Service) holdTTL() int64 { return int64(2 * s.cfg.DecisionTimeout) }

// resolveHold decodes a hold forwarded to this node (the decide body, the
// layer's policy in PolicyHeader) into rq.
func (s *Service) resolveHold(rq *routed, caller string) error {
	req, err := decodeRequest(rq.r.Data())
	if err != nil {
		return err
	}
	own, _ := req.desc.Get("tenant")
	if caller != "" {
		if req.desc, err = bindTenant(req.desc, caller, own); err != nil {
			return err
		}
	}
	name := rq.r.Headers().Get(PolicyHeader)
	p := s.cfg.Policies.Current(name)
	if p == nil || p.Shadow {
		return fmt.Errorf("%w: layer policy %q is not in force here", fail.ErrUnavailable, name)
	}
	rq.req, rq.p = req, p
	return s.holdOp(rq)
}

// holdOp fills in rq's limit key and its hold operation.
func (s *Service) holdOp(rq *routed) error {
	var err error
	if rq.key, err = rq.p.LimitKey(rq.req.desc); err != nil {
		return fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	if len(rq.key) > keyrec.MaxReservedKey {
		return fmt.Errorf("%w: the limit key of layer policy %q is %d bytes; a layer's key is at most %d bytes",
			fail.ErrBadRequest, rq.p.Name, len(rq.key), keyrec.MaxReservedKey)
	}
	rq.res = keys.ResOp{Kind: keys.ResReserve, TTL: s.holdTTL(), Hold: true,
		Nonce: s.cfg.Nonce() & (1<<keyrec.NonceBits - 1)}
	return nil
}

// appendHoldReply appends a hold's reply: the decide reply plus, when
// held, the hold's id.
func appendHoldReply(b []byte, d keyrec.Decision, id string) []byte {
	b = appendReply(b, d, -1)
	if d.Allowed {
		b = b[:len(b)-1]
		b = append(b, `,"reservation":`...)
		b = wire.AppendString(b, id)
		b = append(b, '}')
	}
	return b
}

// layerCall is one layer of a multi-layer decision: a micro.Request whose
// reply the coordinator reads (in-process or relayed from the owner).
type layerCall struct {
	l    *layerDecision
	i    int
	data []byte
	hdr  micro.Headers
	// once: the reply or error, then done.
	code, msg string
	reply     holdReply
	decided   bool
}

// holdReply is a hold's (or a local decision's) reply.
type holdReply struct {
	Allowed      bool        `json:"allowed"`
	Policy       string      `json:"policy"`
	Revision     uint64      `json:"revision"`
	Remaining    json.Number `json:"remaining"`
	RetryAfterMs int64       `json:"retry_after_ms"`
	ResetAfterMs int64       `json:"reset_after_ms"`
	Reservation  string      `json:"reservation"`
}

func (c *layerCall) Respond(b []byte, opts ...micro.RespondOpt) error {
	// A relayed error reply carries its code in headers.
	var r holdReply
	if err := json.Unmarshal(b, &r); err != nil {
		c.code, c.msg = "500", "undecodable layer reply: "+err.Error()
	} else {
		c.reply = r
	}
	for _, o := range opts {
		if h := headersOf(o); h != nil {
			if code := h.Get(micro.ErrorCodeHeader); code != "" {
				c.code, c.msg = code, h.Get(micro.ErrorHeader)
			}
		}
	}
	c.l.answered(c)
	return nil
}

func (c *layerCall) RespondJSON(v any, opts ...micro.RespondOpt) error {
	b, err := json.Marshal(v)
	if err != nil {
		return micro.ErrMarshalResponse
	}
	return c.Respond(b, opts...)
}

func (c *layerCall) Error(code, desc string, _ []byte, _ ...micro.RespondOpt) error {
	c.code, c.msg = code, desc
	c.l.answered(c)
	return nil
}

func (c *layerCall) Data() []byte           { return c.data }
func (c *layerCall) Headers() micro.Headers { return c.hdr }
func (c *layerCall) Subject() string        { return "" }
func (c *layerCall) Reply() string          { return "" }

// headersOf returns the headers a RespondOpt sets (a relayed reply's).
func headersOf(o micro.RespondOpt) micro.Headers {
	m := &nats.Msg{Header: nats.Header{}}
	o(m)
	if len(m.Header) == 0 {
		return nil
	}
	return micro.Headers(m.Header)
}

// layerDecision is one multi-layer decision in progress.
type layerDecision struct {
	s *Service
	r micro.Request
	// Per call (one per layer of each descriptor): its request and
	// policy, and its descriptor's index (decide_all; 0 otherwise).
	reqs   []request
	ps     []*policies.Policy
	group  []int
	all    bool // a decide_all request: one result per descriptor
	groups int
	dryRun bool
	start  time.Time
	caller string

	mu    sync.Mutex
	calls []*layerCall
	left  int
	phase int // 0 holds, 1 releases
}

// decideLayers decides req, which meets the policies ps (one per layer,
// more than one), all or nothing, and answers r.
func (s *Service) decideLayers(r micro.Request, req request, ps []*policies.Policy, start time.Time, caller string) {
	for _, p := range ps {
		if p.ReservedOnly() {
			if !req.dryRun {
				s.m.decision(p.Name, resError)
			}
			s.replyError(r, p.Name, start, fmt.Errorf("%w: layer policy %q has a concurrency limit: it is reserved with %s.v1.reserve, not decided",
				fail.ErrBadRequest, p.Name, s.prefix()))
			return
		}
	}
	ld := &layerDecision{s: s, r: r, ps: ps, start: start, caller: caller, dryRun: req.dryRun, groups: 1}
	ld.reqs = make([]request, len(ps))
	ld.group = make([]int, len(ps))
	for i := range ps {
		ld.reqs[i] = req
	}
	ld.run(nil)
}

// run starts the decision's holds; bodies, when not nil, are the calls'
// own decide bodies (decide_all), else each call forwards r's.
func (ld *layerDecision) run(bodies [][]byte) {
	r, ps := ld.r, ld.ps
	var held []int
	for i, p := range ps {
		if p.Mode != policies.ModeLocal {
			held = append(held, i)
		}
	}
	ld.calls = make([]*layerCall, len(ps))
	for i := range ps {
		ld.calls[i] = &layerCall{l: ld, i: i, data: r.Data(), hdr: r.Headers()}
		if bodies != nil {
			ld.calls[i].data = bodies[i]
		}
	}
	if len(held) == 0 {
		ld.finishHolds()
		return
	}
	ld.left = len(held)
	for _, i := range held {
		ld.hold(i)
	}
}

// hold routes layer i's hold to its key's owner.
func (ld *layerDecision) hold(i int) {
	s := ld.s
	c := ld.calls[i]
	rq := &routed{s: s, r: c, op: opHold, p: ld.ps[i], req: ld.reqs[i], start: ld.start,
		deadline: ld.start.Add(s.cfg.DecisionTimeout), noHint: true}
	if err := s.holdOp(rq); err != nil {
		c.code, c.msg = errorCode(err), err.Error()
		ld.answered(c)
		return
	}
	rq.part, rq.keyPart = -1, -1
	if s.cfg.Route != nil {
		rq.part = ownership.PartitionOf(rq.key, s.cfg.Route.Parts())
		rq.keyPart = rq.part
	}
	s.inflight.Add(1) // the sub-call's reply decrements it
	s.route(rq, s.cfg.Runtime.Now())
}

// answered is told that c has its reply.
func (ld *layerDecision) answered(c *layerCall) {
	ld.mu.Lock()
	c.decided = true
	ld.left--
	last := ld.left == 0
	phase := ld.phase
	ld.mu.Unlock()
	if !last {
		return
	}
	if phase == 0 {
		ld.finishHolds()
	} else {
		ld.finishReleases()
	}
}

// finishHolds runs once every hold is answered: local layers, then commit
// or release. It answers admitted only when every non-local layer held
// (A2) and, when one denied, only after the releases are written (A3).
func (ld *layerDecision) finishHolds() {
	admitted := true
	for i, c := range ld.calls {
		if ld.ps[i].Mode == policies.ModeLocal {
			continue
		}
		if c.code != "" || !c.reply.Allowed {
			admitted = false
		}
	}
	if admitted && !ld.dryRun {
		// Local layers, decided here once the others hold.
		for i, p := range ld.ps {
			if p.Mode != policies.ModeLocal || !admitted {
				continue
			}
			admitted = ld.decideLocal(i)
		}
	} else if ld.dryRun {
		for i, p := range ld.ps {
			if p.Mode == policies.ModeLocal {
				ld.decideLocal(i)
			}
		}
	}
	if admitted || ld.dryRun {
		if !ld.dryRun {
			ld.commit()
		}
		ld.reply(nil)
		return
	}
	// Release what was held, then answer.
	var release []int
	for i, c := range ld.calls {
		if c.code == "" && c.reply.Allowed && c.reply.Reservation != "" {
			release = append(release, i)
		}
	}
	if len(release) == 0 {
		ld.reply(nil)
		return
	}
	ld.mu.Lock()
	ld.phase, ld.left = 1, len(release)
	ld.mu.Unlock()
	for _, i := range release {
		ld.end(i, opRelease, &releaseCall{l: ld, i: i})
	}
}

// decideLocal decides local layer i here (a plain decision) and reports
// whether it admitted.
func (ld *layerDecision) decideLocal(i int) bool {
	s := ld.s
	p := ld.ps[i]
	c := ld.calls[i]
	req := ld.reqs[i]
	key, err := p.LimitKey(req.desc)
	if err != nil {
		c.code, c.msg = "400", err.Error()
		return false
	}
	now := s.cfg.Runtime.Now()
	call := keys.Call{Policy: p, Cost: req.cost, DryRun: req.dryRun, Deadline: now.Add(s.cfg.DecisionTimeout).UnixNano(),
		Done: finisherFunc(func(*keys.Call) {})}
	s.cfg.Keys.Submit(key, &call, now.UnixNano(), nil) // local: decided before Submit returns
	if call.Err != nil {
		c.code, c.msg = errorCode(call.Err), call.Err.Error()
		return false
	}
	d := call.Out
	c.reply = holdReply{Allowed: d.Allowed, Policy: d.Policy, Revision: d.Revision,
		Remaining:    json.Number(string(AppendMicro(nil, max(d.Remaining, 0)))),
		RetryAfterMs: durationMillis(d.RetryAfter), ResetAfterMs: durationMillis(d.ResetAfter)}
	if !req.dryRun && s.cfg.Usage != nil {
		rq := &routed{req: req, key: key}
		s.record(rq, &call)
	}
	return d.Allowed
}

type finisherFunc func(*keys.Call)

func (f finisherFunc) Finish(c *keys.Call) { f(c) }

// commit settles every hold whole (presumed commit: a lost settle lets
// the hold expire as spent, the same outcome).
func (ld *layerDecision) commit() {
	for i, c := range ld.calls {
		if c.reply.Reservation != "" {
			ld.end(i, opSettle, &releaseCall{l: ld, i: i, commit: true})
		}
	}
}

// end routes a settle (commit) or release of layer i's hold, answered to
// rc.
func (ld *layerDecision) end(i int, kind resKind, rc *releaseCall) {
	s := ld.s
	b, _ := json.Marshal(map[string]string{"reservation": ld.calls[i].reply.Reservation})
	rc.data, rc.hdr = b, ld.r.Headers()
	rq := &routed{s: s, r: rc, op: kind, start: s.cfg.Runtime.Now(), noHint: true}
	rq.deadline = rq.start.Add(s.cfg.DecisionTimeout)
	if err := s.resolveEnd(rq, ld.caller); err != nil {
		rc.code = errorCode(err)
		rc.done()
		return
	}
	if s.cfg.Route != nil {
		rq.part = ownership.PartitionOf(rq.key, s.cfg.Route.Parts())
		rq.keyPart = rq.part
	}
	s.inflight.Add(1)
	s.route(rq, rq.start)
}

// releaseCall is the micro.Request of a hold's commit or release.
type releaseCall struct {
	l      *layerDecision
	i      int
	commit bool
	data   []byte
	hdr    micro.Headers
	code   string
}

func (c *releaseCall) Respond(_ []byte, opts ...micro.RespondOpt) error {
	for _, o := range opts {
		if h := headersOf(o); h != nil {
			if code := h.Get(micro.ErrorCodeHeader); code != "" {
				c.code = code
			}
		}
	}
	c.done()
	return nil
}

func (c *releaseCall) RespondJSON(any, ...micro.RespondOpt) error { c.done(); return nil }
func (c *releaseCall) Error(code, _ string, _ []byte, _ ...micro.RespondOpt) error {
	c.code = code
	c.done()
	return nil
}
func (c *releaseCall) Data() []byte           { return c.data }
func (c *releaseCall) Headers() micro.Headers { return c.hdr }
func (c *releaseCall) Subject() string        { return "" }
func (c *releaseCall) Reply() string          { return "" }

// done: a commit needs nothing more; a release counts toward the answer.
func (c *releaseCall) done() {
	if c.commit {
		if c.code != "" {
			c.l.s.log.Debug("layer hold commit failed; it expires as spent", "code", c.code)
		}
		return
	}
	ld := c.l
	ld.mu.Lock()
	if c.code != "" {
		ld.calls[c.i].code = "release:" + c.code
	}
	ld.left--
	last := ld.left == 0
	ld.mu.Unlock()
	if last {
		ld.finishReleases()
	}
}

// finishReleases answers a denied decision once its releases are in.
func (ld *layerDecision) finishReleases() {
	for _, c := range ld.calls {
		if strings.HasPrefix(c.code, "release:") {
			ld.reply(fmt.Errorf("%w: a layer's hold could not be released (it expires as spent within %s)",
				fail.ErrUnavailable, time.Duration(ld.s.holdTTL())))
			return
		}
	}
	ld.reply(nil)
}

// reply answers the decision (CONTRACT §11) or, with err or a layer's
// error, the error.
func (ld *layerDecision) reply(err error) {
	s := ld.s
	if err == nil {
		for _, c := range ld.calls {
			if c.code != "" {
				err = codeError(c.code, c.msg)
				break
			}
		}
	}
	if err != nil {
		if !ld.dryRun {
			for _, p := range ld.ps {
				s.m.decision(p.Name, resError)
			}
		}
		s.replyError(ld.r, ld.ps[0].Name, ld.start, err)
		return
	}
	admitted := ld.admitted()
	res := resDenied
	if admitted {
		res = resAllowed
	}
	if !ld.dryRun {
		for _, p := range ld.ps {
			s.m.decision(p.Name, res)
		}
	}
	if ld.all {
		ld.replyAll(admitted)
		return
	}
	d, _ := ld.combine(0, admitted)
	b := appendReply(nil, d, -1)
	b = append(b[:len(b)-1], `,"layers":[`...)
	for i, c := range ld.calls {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"layer":`...)
		b = wire.AppendString(b, ld.ps[i].Layer)
		b = append(b, `,"policy":`...)
		b = wire.AppendString(b, ld.ps[i].Name)
		b = append(b, `,"revision":`...)
		b = strconv.AppendUint(b, c.reply.Revision, 10)
		b = append(b, `,"allowed":`...)
		b = strconv.AppendBool(b, c.reply.Allowed)
		b = append(b, `,"remaining":`...)
		b = AppendMicro(b, max(ld.holds(i, admitted), 0))
		b = append(b, '}')
	}
	b = append(b, "]}"...)
	s.replyRaw(ld.r, ld.start, b)
}

// admitted reports whether every call admitted.
func (ld *layerDecision) admitted() bool {
	for _, c := range ld.calls {
		if !c.reply.Allowed {
			return false
		}
	}
	return true
}

// holds returns what call i's layer holds as the decision leaves it: its
// reply's remaining, plus the cost when its hold was released (the
// decision denied) or, for a denied decide dry run, would have been.
func (ld *layerDecision) holds(i int, admitted bool) int64 {
	c := ld.calls[i]
	rem := microOf(string(c.reply.Remaining))
	if !admitted && c.reply.Allowed && (c.reply.Reservation != "" || ld.dryRun && !ld.all) {
		rem += ld.reqs[i].cost
	}
	return rem
}

// combine returns the decision of descriptor group g's layers (CONTRACT
// §11): allowed when each admitted; the policy, revision and times of the
// denying layer with the longest retry, or of the admitting one with the
// least left; the least left. false when no layer matched g.
func (ld *layerDecision) combine(g int, admitted bool) (keyrec.Decision, bool) {
	best, remaining := -1, int64(0)
	allowed := true
	for i, c := range ld.calls {
		if ld.group[i] != g {
			continue
		}
		rem := ld.holds(i, admitted)
		if best < 0 || rem < remaining {
			remaining = rem
		}
		switch {
		case best < 0:
			best = i
		case !c.reply.Allowed:
			if b := ld.calls[best].reply; b.Allowed || longerRetry(c.reply.RetryAfterMs, b.RetryAfterMs) {
				best = i
			}
		case ld.calls[best].reply.Allowed && rem < ld.holds(best, admitted):
			best = i
		}
		allowed = allowed && c.reply.Allowed
	}
	if best < 0 {
		return keyrec.Decision{Allowed: true}, false
	}
	br := ld.calls[best].reply
	d := keyrec.Decision{Allowed: allowed, Policy: br.Policy, Revision: br.Revision, Remaining: remaining,
		ResetAfter: br.ResetAfterMs * int64(time.Millisecond)}
	switch {
	case allowed:
	case br.RetryAfterMs < 0:
		d.RetryAfter = kvstate.Never
	default:
		d.RetryAfter = br.RetryAfterMs * int64(time.Millisecond)
	}
	return d, true
}

// longerRetry reports whether retry a (ms, -1 never) is longer than b.
func longerRetry(a, b int64) bool {
	switch {
	case b == -1:
		return false
	case a == -1:
		return true
	}
	return a > b
}

// microOf parses a reply's decimal number of units into micro-units (0
// when it is not one).
func microOf(s string) int64 {
	v, err := policies.ParseUnits(s)
	if err != nil {
		return 0
	}
	return v
}

// errorCode is the micro error code replyError gives err.
func errorCode(err error) string {
	code, _, _ := classify(err)
	return code
}

// codeError turns a layer's error reply back into the error to answer.
func codeError(code, msg string) error {
	switch code {
	case "400":
		return fmt.Errorf("%w: %s", fail.ErrBadRequest, msg)
	case "403":
		return fmt.Errorf("%w: %s", fail.ErrForbidden, msg)
	case "413":
		return fmt.Errorf("%w: %s", fail.ErrTooLarge, msg)
	case "503":
		return fmt.Errorf("%w: %s", fail.ErrUnavailable, msg)
	}
	return fmt.Errorf("%w: a layer answered %s: %s", fail.ErrInternal, code, msg)
}

// decide_all (docs/protocol.md "Layers"): several descriptors decided all
// or nothing, each by every layer it meets: what the Envoy bridge asks for
// a request's descriptors (CONTRACT §12). Body:
//
//	{"descriptors":[{"descriptor":{...},"cost":3,"dry_run":false},...]}
//
// (at most MaxAllDescriptors, each as in a decide request; at most
// MaxAllBytes). Reply: {"allowed":bool,"results":[<a decide reply per
// descriptor, without layers>]}: allowed when every descriptor is; then
// each spent in all its layers, else none spent anywhere (a dry_run
// descriptor is only read). Errors as decide's.

// MaxAllDescriptors is the most descriptors of one decide_all request.
const MaxAllDescriptors = 64

// MaxAllBytes is the largest decide_all body.
const MaxAllBytes = 64 << 10

// HandleDecideAll is the handler of the decide_all endpoint.
func (s *Service) HandleDecideAll(r micro.Request) {
	start := s.cfg.Runtime.Now()
	s.inflight.Add(1)
	caller, ok := s.callerOf(r, start)
	if !ok {
		return
	}
	reqs, err := decodeAll(r.Data())
	if err != nil {
		s.replyError(r, "", start, err)
		return
	}
	snap := s.cfg.Policies.Snapshot()
	ld := &layerDecision{s: s, r: r, start: start, caller: caller, all: true, groups: len(reqs), dryRun: true}
	var bodies [][]byte
	for g, req := range reqs {
		if caller != "" {
			own, _ := req.desc.Get("tenant")
			if req.desc, err = bindTenant(req.desc, caller, own); err != nil {
				s.replyError(r, "", start, err)
				return
			}
		}
		for _, p := range snap.MatchLayers(req.desc, nil) {
			if p.ReservedOnly() {
				s.replyError(r, p.Name, start, fmt.Errorf("%w: policy %q has a concurrency limit: it is reserved with %s.v1.reserve, not decided",
					fail.ErrBadRequest, p.Name, s.prefix()))
				return
			}
			ld.reqs = append(ld.reqs, req)
			ld.ps = append(ld.ps, p)
			ld.group = append(ld.group, g)
			bodies = append(bodies, decideBody(req))
		}
		ld.dryRun = ld.dryRun && req.dryRun
	}
	ld.run(bodies)
}

// decodeAll decodes a decide_all body.
func decodeAll(b []byte) ([]request, error) {
	if len(b) > MaxAllBytes {
		return nil, fmt.Errorf("%w: body is %d bytes, at most %d", fail.ErrTooLarge, len(b), MaxAllBytes)
	}
	var body struct {
		Descriptors []json.RawMessage `json:"descriptors"`
	}
	if err := json.Unmarshal(b, &body); err != nil {
		return nil, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	if n := len(body.Descriptors); n == 0 || n > MaxAllDescriptors {
		return nil, fmt.Errorf("%w: descriptors: %d, want 1..%d", fail.ErrBadRequest, n, MaxAllDescriptors)
	}
	out := make([]request, len(body.Descriptors))
	for i, d := range body.Descriptors {
		req, err := decodeRequest(d) // each item is a decide body
		if err != nil {
			return nil, fmt.Errorf("descriptors[%d]: %w", i, err)
		}
		out[i] = req
	}
	return out, nil
}

// decideBody is the decide body of req (a layer's hold forwarded to its
// key's owner re-decodes it).
func decideBody(req request) []byte {
	b := []byte(`{"descriptor":{`)
	for i, d := range req.desc {
		if i > 0 {
			b = append(b, ',')
		}
		b = wire.AppendString(b, d.Name)
		b = append(b, ':')
		b = wire.AppendString(b, d.Value)
	}
	b = append(b, `},"cost":`...)
	b = AppendMicro(b, req.cost)
	if req.dryRun {
		b = append(b, `,"dry_run":true`...)
	}
	return append(b, '}')
}

// replyAll answers a decide_all request: one decide reply per
// descriptor, each combining its layers as decide does.
func (ld *layerDecision) replyAll(admitted bool) {
	b := []byte(`{"allowed":`)
	b = strconv.AppendBool(b, admitted)
	b = append(b, `,"results":[`...)
	for g := range ld.groups {
		if g > 0 {
			b = append(b, ',')
		}
		d, _ := ld.combine(g, admitted) // no layer: not limited
		b = appendReply(b, d, -1)
	}
	b = append(b, "]}"...)
	ld.s.replyRaw(ld.r, ld.start, b)
}
