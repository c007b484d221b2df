package sim

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/service"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/prometheus/client_golang/prometheus"
)

// Config is one simulated run.
type Config struct {
	Seed       uint64
	Nodes      int           // nodes in the mesh (3)
	Parts      int           // partitions (8)
	Lease      time.Duration // partition lease (600 ms)
	Timeout    time.Duration // decision timeout, bounds every store operation (200 ms)
	Checkpoint time.Duration // checkpoint interval (300 ms)
	Duration   time.Duration // simulated time with traffic and faults (6 s)
	Settle     time.Duration // fault-free time at the end (4 s)
	Rate       float64       // decide requests per simulated second, over all nodes (120)
	Loss       float64       // probability a request or an answer is lost, faults or not (0.01; negative: none)
	ReplicaLag float64       // probability a direct get is answered by a replica a few messages behind (0.2; negative: none)
	Faults     bool          // crashes, leaves, cuts, stale leaders, elections, watch stalls and lag, process pauses, clock errors
	// Limit is the count policy's limit. By default it is sized to the
	// offered load (128): a count key admits through the faults, and most
	// reach their limit in the settle time.
	Limit int
	Debug bool // the nodes' debug logs go into the trace
	// Reserve is the rate of reservations (reserve requests per simulated
	// second, over all nodes, 16); NoReservations turns them off (the
	// schedules of the seeds kept from before reservations).
	Reserve        float64
	NoReservations bool
	// NoLeased turns the leased keys' clients and holders off.
	NoLeased bool
}

// Defaults fills in unset fields.
func (c Config) Defaults() Config {
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	if c.Nodes == 0 {
		c.Nodes = 3
	}
	if c.Parts == 0 {
		c.Parts = 8
	}
	def(&c.Lease, 600*time.Millisecond)
	def(&c.Timeout, 200*time.Millisecond)
	def(&c.Checkpoint, 300*time.Millisecond)
	def(&c.Duration, 6*time.Second)
	def(&c.Settle, 4*time.Second)
	if c.Rate == 0 {
		c.Rate = 120
	}
	if c.Limit == 0 {
		perKey := c.Rate / decideKeys // requests per second of one count key
		c.Limit = int(perKey * (c.Duration + c.Settle/4 - c.Lease).Seconds())
	}
	if c.Reserve == 0 {
		c.Reserve = 16
	}
	if c.Loss == 0 {
		c.Loss = 0.01
	}
	if c.ReplicaLag == 0 {
		c.ReplicaLag = 0.2
	}
	return c
}

// Sim is one simulated mesh.
type Sim struct {
	cfg      Config
	s        *sched
	nodes    []*node
	shards   *stream // KV_rl_shards
	state    *stream // KV_rl_state
	journal  *stream // RL_JOURNAL
	watchers []*node
	policies *policyset.Set
	keys     []*simKey // the keys decide clients spend (count and rate)
	resKeys  []*simKey // the keys reserving clients hold (rate and conc)
	leased   []*simKey // the leased policy's keys (leased.go)
	faulty   bool      // faults may be injected now
	trace    []string
	check    *checker
	res      *resChecker
	usage    *usageModel
	// claims[p][rev] is the node whose claim of partition p landed at
	// revision rev (the epoch it serves in).
	claims []map[uint64]string
	// calls: the client call each request body in flight carries (net.go);
	// spentByHolder: the calls a node admitted from its grant (client.go);
	// byName: the keys by limit key; svcMetrics: the services' metrics.
	calls         map[*byte]*clientCall
	spentByHolder map[string]bool
	byName        map[string]*simKey
	svcMetrics    *service.Metrics
}

// simKey is one limit key the clients spend.
type simKey struct {
	name   string // limit key
	part   int
	p      *policies.Policy
	desc   policies.Descriptor
	count  bool // the count policy (fixed_window)
	leased bool // the leased policy (token_bucket, leased mode)
	conc   bool // the conc policy (concurrency: reserved only); neither: the rate policy (token_bucket)
	// resEnd is the global instant its reserving clients stop (resclient.go).
	resEnd int64
}

// The policies of a run: "count", a fixed window far longer than the run
// (so the state only grows: the count a decision reports is the number of
// admissions so far), "rate", a token bucket (decided and reserved), and
// "conc", a concurrency limit (reserved only; no window: a hold lasts as
// long as its reservation).
const (
	countPolicy = `{"match":{"kind":"count"},"key":["k"],"limits":[{"algorithm":"fixed_window","limit":%d,"window":"10000h"}]}`
	ratePolicy  = `{"match":{"kind":"rate"},"key":["k"],"limits":[{"algorithm":"token_bucket","rate":"5/s","burst":10}]}`
	concPolicy  = `{"match":{"kind":"conc"},"key":["k"],"limits":[{"algorithm":"concurrency","limit":3}]}`
	rateBurst   = 10
	decideKeys  = 6 // the keys the decide clients spend: 3 count, 3 rate
	ratePerSec  = 5
	concLimit   = 3
)

// Clock errors of the nodes with faults: rate (ppm) and offset (ns). The
// lease rules tolerate rate errors far above real clocks' (a node waits a
// whole lease from what it observed, an owner stops 2/3 of a lease after
// what it sent).
const (
	maxDrift  = 30_000
	maxOffset = int64(50 * time.Millisecond)
)

// New builds a simulation of cfg (with Defaults).
func New(cfg Config) (*Sim, error) {
	cfg = cfg.Defaults()
	s := &Sim{cfg: cfg, s: newSched(cfg.Seed), shards: newStream("KV_rl_shards"),
		state: newStream("KV_rl_state"), journal: newStream("RL_JOURNAL"), policies: policyset.New(),
		calls: map[*byte]*clientCall{}, spentByHolder: map[string]bool{}, byName: map[string]*simKey{}}
	var err error
	if s.svcMetrics, err = service.NewMetrics(prometheus.NewRegistry()); err != nil {
		return nil, err
	}
	s.claims = make([]map[uint64]string, cfg.Parts)
	for p := range s.claims {
		s.claims[p] = map[uint64]string{}
	}
	for i, doc := range []string{fmt.Sprintf(countPolicy, cfg.Limit), ratePolicy, concPolicy, leasedPolicy} {
		name := []string{"count", "rate", "conc", "leased"}[i]
		p, err := policyset.Parse(name, []byte(doc), uint64(i+1))
		if err != nil {
			return nil, err
		}
		s.policies.Put(p, epoch)
		for k := range []int{3, 3, 2, leasedKeys}[i] { // keys of the policy
			d, err := policies.NewDescriptor([]policies.Dim{{Name: "k", Value: strconv.Itoa(k)}, {Name: "kind", Value: name}})
			if err != nil {
				return nil, err
			}
			key, err := p.LimitKey(d)
			if err != nil {
				return nil, err
			}
			sk := &simKey{name: key, part: ownership.PartitionOf(key, cfg.Parts), p: p, desc: d, count: i == 0, conc: i == 2, leased: i == 3}
			s.byName[key] = sk
			switch i {
			case 0:
				s.keys = append(s.keys, sk)
			case 1:
				s.keys = append(s.keys, sk)
				s.resKeys = append(s.resKeys, sk)
			case 2:
				s.resKeys = append(s.resKeys, sk)
			case 3:
				s.leased = append(s.leased, sk)
			}
		}
	}
	s.check = newChecker(s)
	s.res = newResChecker(s)
	s.usage = &usageModel{}
	s.s.onStep = s.check.step
	for i := range cfg.Nodes {
		n := &node{sim: s, id: "n" + strconv.Itoa(i)}
		if cfg.Faults {
			n.drift = s.s.between(-maxDrift, maxDrift)
			n.offset = s.s.between(-maxOffset, maxOffset)
		}
		s.nodes = append(s.nodes, n)
	}
	return s, nil
}

func (s *Sim) logf(format string, a ...any) {
	s.trace = append(s.trace, fmt.Sprintf("%9.3fs ", float64(s.s.now)/1e9)+fmt.Sprintf(format, a...))
}

// Trace returns the notable events of the run (crashes, cuts, ...).
func (s *Sim) Trace() string {
	t := s.trace
	if len(t) > 200 && !s.cfg.Debug {
		t = append([]string{fmt.Sprintf("... %d earlier lines", len(t)-200)}, t[len(t)-200:]...)
	}
	return strings.Join(t, "\n")
}

// Steps returns the number of events run.
func (s *Sim) Steps() int { return s.s.steps }

// Run runs the simulation; it returns the first invariant violated.
func (s *Sim) Run() error {
	cfg := s.cfg
	lease := int64(cfg.Lease)
	for _, n := range s.nodes {
		s.s.after(s.s.between(0, lease), nil, func() {
			s.logf("%s starts", n.id)
			n.start()
		})
	}
	s.clients(int64(cfg.Duration + cfg.Settle - cfg.Lease))
	if !cfg.NoReservations {
		s.reservers()
	}
	if !cfg.NoLeased {
		s.leasedClients(int64(cfg.Duration + cfg.Settle - cfg.Lease))
	}
	if cfg.Faults {
		s.faulty = true
		s.s.after(2*lease, nil, s.fault)
	}
	end := int64(cfg.Duration)
	s.s.at(end, nil, s.heal)
	// A node that was stopping when the faults ended comes back within
	// 3 leases; the mesh then converges within the rest of the settle time.
	s.s.runUntil(end + int64(cfg.Settle))
	return s.check.final()
}

// watchLag is a watch delivery's delay: usually short, sometimes long.
func (s *Sim) watchLag() int64 {
	if s.faulty && s.s.chance(0.03) {
		return s.s.between(int64(10*time.Millisecond), int64(s.cfg.Lease/2))
	}
	return s.s.between(int64(50*time.Microsecond), int64(3*time.Millisecond))
}

// netDelay is one way of a request or an answer.
func (s *Sim) netDelay() int64 {
	if s.faulty && s.s.chance(0.02) {
		return s.s.between(int64(5*time.Millisecond), int64(s.cfg.Timeout))
	}
	return s.s.between(int64(30*time.Microsecond), int64(700*time.Microsecond))
}

// writeShard writes an entry of the shards bucket and hands it to the
// watches.
func (s *Sim) writeShard(key string, val []byte, deleted bool) uint64 {
	rev := s.shards.add(key, val, deleted)
	if s.cfg.Debug && strings.HasPrefix(key, "part.") {
		s.logf("shards: %s = %s (deleted %v) at revision %d", key, val, deleted, rev)
	}
	if p, ok := strings.CutPrefix(key, "part."); ok && !deleted && !strings.Contains(string(val), `"epoch"`) {
		if n, err := strconv.Atoi(p); err == nil && n < len(s.claims) {
			node := strings.TrimSuffix(strings.TrimPrefix(string(val), `{"node":"`), `"}`)
			node, _, _ = strings.Cut(node, `"`)
			s.claims[n][rev] = node
		}
	}
	e := ownership.Entry{Key: key, Value: val, Rev: rev, Deleted: deleted}
	for _, n := range s.watchers {
		n.deliverWatch(e)
	}
	return rev
}

// appendJournal appends a message to the journal stream.
func (s *Sim) appendJournal(subj string, data []byte) uint64 {
	s.res.journalled(data)
	return s.journal.add(subj, data, false)
}

// shardEntries returns the latest entry of every key of the shards bucket.
func (s *Sim) shardEntries() []ownership.Entry {
	var out []ownership.Entry
	for subj := range s.shards.bySubj {
		m, ok := s.shards.lastOf(subj, s.shards.last())
		if !ok {
			continue
		}
		out = append(out, ownership.Entry{Key: subj, Value: m.data, Rev: m.seq, Deleted: m.deleted})
	}
	slicesSortEntries(out)
	return out
}
