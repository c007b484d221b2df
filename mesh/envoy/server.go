package envoy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/limitmesh/limitmesh/policies"
)

// ServiceName is the gRPC service the bridge implements; health checks
// answer for it and for "" (the server as a whole).
const ServiceName = "envoy.service.ratelimit.v3.RateLimitService"

// MaxDescriptors is the most descriptors one ShouldRateLimit call may
// carry (each is one decide request, all in flight at once); a call with
// more, or with none, is refused with INVALID_ARGUMENT.
const MaxDescriptors = 64

// DefaultTimeout is Config.Timeout's default.
const DefaultTimeout = time.Second

// readyPoll is how often the health status follows Config.Ready.
const readyPoll = 250 * time.Millisecond

// refusalLogEvery bounds the refused-descriptor warnings to one per period.
const refusalLogEvery = 10 * time.Second

// Config configures a [Server].
type Config struct {
	// Conn is the NATS connection the decide requests are sent on
	// (required). It stays the caller's: the Server never closes it.
	Conn *nats.Conn
	// Prefix is the subject prefix of the decide service; default "rl".
	Prefix string
	// Timeout bounds one decide request when the RPC carries no deadline
	// (Envoy sends its filter's timeout as the RPC's); default
	// DefaultTimeout. Keep it above the nodes' decision timeout, so that a
	// node's 503 arrives before it.
	Timeout time.Duration
	// Policy returns the policy in force with the given name, nil when
	// there is none (the node's view); it gives statuses their
	// current_limit. nil: no status carries a current_limit.
	Policy func(name string) *policies.Policy
	// Ready reports whether decisions can be made (the node's readiness);
	// the health service answers SERVING while it is true and the Server
	// is not shutting down. nil: always ready.
	Ready func() bool
	// Registry gets the bridge's metrics (limitmesh_envoy_*); nil: a
	// registry of its own, not served.
	Registry prometheus.Registerer
	// Logger; nil discards.
	Logger *slog.Logger
	// ServerOptions are added to the gRPC server's.
	ServerOptions []grpc.ServerOption
}

// Server is the Envoy rate limit service. Create it with [New], run it
// with [Server.Serve], stop it with [Server.Shutdown]. Its methods are safe
// for concurrent use.
type Server struct {
	rlsv3.UnimplementedRateLimitServiceServer

	cfg    Config
	log    *slog.Logger
	client *client.Client
	grpc   *grpc.Server
	health *health.Server
	m      *metrics
	limits limitCache

	stopOnce  sync.Once
	stopping  atomic.Bool
	stopPoll  chan struct{}
	lastRefus atomic.Int64 // unix ns of the last refusal warning
}

// New returns a Server deciding through cfg.Conn. Errors wrap ErrConfig.
func New(cfg Config) (*Server, error) {
	if cfg.Conn == nil {
		return nil, fmt.Errorf("%w: nil NATS connection", ErrConfig)
	}
	if cfg.Prefix == "" {
		cfg.Prefix = client.DefaultPrefix
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	s := &Server{cfg: cfg, log: cfg.Logger, stopPoll: make(chan struct{})}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	var err error
	if s.client, err = client.New(cfg.Conn, client.Prefix(cfg.Prefix), client.Timeout(cfg.Timeout)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if s.m, err = newMetrics(cfg.Registry); err != nil {
		return nil, fmt.Errorf("%w: metrics: %w", ErrConfig, err)
	}
	s.grpc = grpc.NewServer(append([]grpc.ServerOption{grpc.ForceServerCodecV2(newCodec())}, cfg.ServerOptions...)...)
	rlsv3.RegisterRateLimitServiceServer(s.grpc, s)
	s.health = health.NewServer()
	healthpb.RegisterHealthServer(s.grpc, s.health)
	reflection.Register(s.grpc)
	s.setHealth()
	return s, nil
}

// Serve accepts connections on l until Shutdown; it returns nil after a
// Shutdown and the listener's error otherwise. Call it once.
func (s *Server) Serve(l net.Listener) error {
	go s.followReady()
	err := s.grpc.Serve(l)
	if errors.Is(err, grpc.ErrServerStopped) || s.stopping.Load() {
		return nil
	}
	return err
}

// Shutdown makes the health service answer NOT_SERVING, stops accepting
// connections and waits for the calls in flight to be answered, bounded by
// ctx (then the remaining ones are cut off). Call it before the node stops
// deciding. It is safe to call more than once.
func (s *Server) Shutdown(ctx context.Context) error {
	var err error
	s.stopOnce.Do(func() {
		s.stopping.Store(true)
		close(s.stopPoll)
		s.health.Shutdown()
		done := make(chan struct{})
		go func() { s.grpc.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-ctx.Done():
			s.grpc.Stop()
			<-done
			err = fmt.Errorf("envoy: shutdown: calls still in flight cut off: %w", ctx.Err())
		}
	})
	return err
}

// followReady keeps the health status in step with Config.Ready until
// Shutdown.
func (s *Server) followReady() {
	if s.cfg.Ready == nil {
		return
	}
	t := time.NewTicker(readyPoll)
	defer t.Stop()
	for {
		select {
		case <-s.stopPoll:
			return
		case <-t.C:
			s.setHealth()
		}
	}
}

func (s *Server) setHealth() {
	st := healthpb.HealthCheckResponse_SERVING
	if s.cfg.Ready != nil && !s.cfg.Ready() {
		st = healthpb.HealthCheckResponse_NOT_SERVING
	}
	if s.stopping.Load() {
		return // health.Shutdown has set NOT_SERVING for good
	}
	s.health.SetServingStatus("", st)
	s.health.SetServingStatus(ServiceName, st)
}

// ShouldRateLimit implements the RPC (CONTRACT.md §12): each descriptor is
// mapped (Map); one descriptor is decided by a decide request, several by
// one decide_all request, all or nothing (decideAll); the answer is
// OVER_LIMIT when any descriptor is over, with one status per descriptor. When any descriptor gets no decision (503, timeout, no
// responders) the call fails with UNAVAILABLE, so that Envoy's
// failure_mode_deny applies; an internal error of the service or a reply
// that does not decode is INTERNAL; no descriptors, or more than
// MaxDescriptors, is INVALID_ARGUMENT.
func (s *Server) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	start := time.Now()
	resp, code, err := s.shouldRateLimit(ctx, req)
	s.m.requests.WithLabelValues(code).Inc()
	s.m.duration.Observe(time.Since(start).Seconds())
	return resp, err
}

func (s *Server) shouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, string, error) {
	descs := req.GetDescriptors()
	switch {
	case len(descs) == 0:
		return nil, codeInvalidArgument, status.Error(codes.InvalidArgument, "limitmesh: the request has no descriptors")
	case len(descs) > MaxDescriptors:
		return nil, codeInvalidArgument, status.Errorf(codes.InvalidArgument, "limitmesh: %d descriptors (at most %d)", len(descs), MaxDescriptors)
	}
	domain, hits := req.GetDomain(), req.GetHitsAddend()
	outs := make([]outcome, len(descs))
	errs := make([]error, len(descs))
	if len(descs) == 1 {
		errs[0] = s.decide(ctx, domain, descs[0], hits, &outs[0])
	} else {
		errs[0] = s.decideAll(ctx, domain, descs, hits, outs)
	}
	// The worst failure answers the call: no decision at all, then an
	// internal error, then a cancelled call.
	var fail error
	for _, rank := range []codes.Code{codes.Unavailable, codes.Internal, codes.Canceled} {
		for _, e := range errs {
			if e != nil && status.Code(e) == rank {
				fail = e
				break
			}
		}
		if fail != nil {
			break
		}
	}
	if fail != nil {
		return nil, failCode(status.Code(fail)), fail
	}
	resp := response(outs)
	for i := range outs {
		s.m.descriptors.WithLabelValues(outs[i].result()).Inc()
	}
	if resp.OverallCode == rlsv3.RateLimitResponse_OVER_LIMIT {
		return resp, codeOverLimit, nil
	}
	return resp, codeOK, nil
}

func failCode(c codes.Code) string {
	switch c {
	case codes.Unavailable:
		return codeUnavailable
	case codes.Canceled:
		return codeCanceled
	}
	return codeInternal
}

// result is the descriptor's label in limitmesh_envoy_descriptors_total.
func (o *outcome) result() string {
	switch {
	case o.err != nil:
		return resultRefused
	case o.m.Skip:
		return resultRefund
	case o.res == nil || o.res.Policy == "":
		return resultUnmatched
	case o.res.Allowed:
		return resultAllowed
	}
	return resultDenied
}

// decide maps and decides one descriptor into o. It returns a gRPC status
// error when the whole call must fail (no decision, internal error,
// cancelled); a refusal is o.err.
func (s *Server) decide(ctx context.Context, domain string, d *ratelimitv3.RateLimitDescriptor, hits uint32, o *outcome) error {
	m, err := Map(domain, d, hits)
	if err != nil {
		o.err = err
		s.refused(err)
		return nil
	}
	o.m = m
	if m.Skip {
		return nil
	}
	dims := make(map[string]string, len(m.Descriptor))
	for _, dim := range m.Descriptor {
		dims[dim.Name] = dim.Value
	}
	var res *client.Result
	if m.DryRun {
		res, err = s.client.Decide(ctx, dims, m.Cost, client.DryRun())
	} else {
		res, err = s.client.Decide(ctx, dims, m.Cost)
	}
	var se *client.ServiceError
	switch {
	case err == nil:
		o.res = res
		if res.Policy != "" && s.cfg.Policy != nil {
			if p := s.cfg.Policy(res.Policy); p != nil {
				o.pl = s.limits.get(p)
			}
		}
		return nil
	case errors.As(err, &se) && (se.Code == 400 || se.Code == 403 || se.Code == 413):
		o.err = fmt.Errorf("%w: the decide service answered %d: %s", ErrRefused, se.Code, se.Message)
		s.refused(o.err)
		return nil
	case client.IsUnavailable(err):
		return status.Error(codes.Unavailable, "limitmesh: no decision: "+err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "limitmesh: the call was cancelled")
	}
	s.log.Warn("envoy: decide failed", "err", err.Error())
	return status.Error(codes.Internal, "limitmesh: "+err.Error())
}

// decideAll maps and decides a request's descriptors all or nothing
// (CONTRACT §12: as layers, §11): one decide_all request, so that when any
// descriptor is over its limit none spends. A refused descriptor makes
// the request over the limit: the others are then only read (dry runs).
// It returns a gRPC status error when the whole call must fail.
func (s *Server) decideAll(ctx context.Context, domain string, descs []*ratelimitv3.RateLimitDescriptor, hits uint32, outs []outcome) error {
	var (
		items   []client.Item
		idx     []int
		refused bool
	)
	for i, d := range descs {
		o := &outs[i]
		m, err := Map(domain, d, hits)
		if err != nil {
			o.err = err
			s.refused(err)
			refused = true
			continue
		}
		o.m = m
		if m.Skip {
			continue
		}
		dims := make(map[string]string, len(m.Descriptor))
		for _, dim := range m.Descriptor {
			dims[dim.Name] = dim.Value
		}
		items = append(items, client.Item{Descriptor: dims, Cost: m.Cost, DryRun: m.DryRun})
		idx = append(idx, i)
	}
	if len(items) == 0 {
		return nil
	}
	if refused {
		for i := range items {
			items[i].DryRun = true
		}
	}
	_, results, err := s.client.DecideAll(ctx, items)
	var se *client.ServiceError
	switch {
	case err == nil:
		for k, i := range idx {
			o := &outs[i]
			o.res = results[k]
			if o.res.Policy != "" && s.cfg.Policy != nil {
				if p := s.cfg.Policy(o.res.Policy); p != nil {
					o.pl = s.limits.get(p)
				}
			}
		}
		return nil
	case errors.As(err, &se) && (se.Code == 400 || se.Code == 403 || se.Code == 413):
		for _, i := range idx {
			outs[i].err = fmt.Errorf("%w: the decide service answered %d: %s", ErrRefused, se.Code, se.Message)
		}
		s.refused(outs[idx[0]].err)
		return nil
	case client.IsUnavailable(err):
		return status.Error(codes.Unavailable, "limitmesh: no decision: "+err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "limitmesh: the call was cancelled")
	}
	s.log.Warn("envoy: decide_all failed", "err", err.Error())
	return status.Error(codes.Internal, "limitmesh: "+err.Error())
}

// refused logs a refused descriptor, at most once per refusalLogEvery.
func (s *Server) refused(err error) {
	now := time.Now().UnixNano()
	last := s.lastRefus.Load()
	if now-last < int64(refusalLogEvery) || !s.lastRefus.CompareAndSwap(last, now) {
		return
	}
	s.log.Warn("envoy: descriptor refused (its status is OVER_LIMIT; further refusals for 10s are only counted in limitmesh_envoy_descriptors_total)", "reason", err.Error())
}
