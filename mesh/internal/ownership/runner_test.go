package ownership

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
)

// manualRT is an rt.Runtime on a clock that moves only when run says so:
// timers fire in instant order, one at a time, on the caller's goroutine.
type manualRT struct {
	now    time.Time
	seq    int
	timers []*manualTimer
}

type manualTimer struct {
	at      time.Time
	seq     int
	f       func()
	stopped bool
}

func (m *manualRT) Now() time.Time { return m.now }

func (m *manualRT) AfterFunc(d time.Duration, f func()) func() bool {
	m.seq++
	t := &manualTimer{at: m.now.Add(max(d, 0)), seq: m.seq, f: f}
	m.timers = append(m.timers, t)
	return func() bool {
		was := !t.stopped
		t.stopped = true
		return was
	}
}

func (m *manualRT) Go(f func()) { m.AfterFunc(0, f) }

// run fires the timers due up to until, then sets the clock to until.
func (m *manualRT) run(until time.Time) {
	for {
		slices.SortFunc(m.timers, func(a, b *manualTimer) int {
			if c := a.at.Compare(b.at); c != 0 {
				return c
			}
			return a.seq - b.seq
		})
		if len(m.timers) == 0 || m.timers[0].at.After(until) {
			break
		}
		t := m.timers[0]
		m.timers = m.timers[1:]
		if !t.stopped {
			m.now = t.at
			t.f()
		}
	}
	m.now = until
}

// lossyKV is a shards bucket on a manualRT: writes land 1 ms after they
// are sent and are answered 1 ms later, and the watch delivers them to
// the runner then; drop decides which renewals are lost (no answer: the
// write reports its timeout).
type lossyKV struct {
	rt   *manualRT
	r    *Runner
	seq  uint64
	revs map[string]uint64
	drop func(renewal int) bool
	// renewals counts the renewals sent.
	renewals int
}

var errLost = fmt.Errorf("lossyKV: no answer: %w", context.DeadlineExceeded)

func (kv *lossyKV) write(key string, val []byte, deleted bool) uint64 {
	kv.seq++
	kv.revs[key] = kv.seq
	e := Entry{Key: key, Value: val, Rev: kv.seq, Deleted: deleted}
	kv.rt.AfterFunc(time.Millisecond, func() { kv.r.Observe(e) })
	return kv.seq
}

func (kv *lossyKV) Update(key string, val []byte, rev uint64, timeout time.Duration, done func(uint64, error)) {
	if bytes.Contains(val, []byte(`"epoch"`)) {
		kv.renewals++
		if kv.drop(kv.renewals) {
			kv.rt.AfterFunc(timeout, func() { done(0, errLost) })
			return
		}
	}
	kv.rt.AfterFunc(time.Millisecond, func() {
		if kv.revs[key] != rev {
			kv.rt.AfterFunc(time.Millisecond, func() { done(0, ErrConflict) })
			return
		}
		r := kv.write(key, val, false)
		kv.rt.AfterFunc(time.Millisecond, func() { done(r, nil) })
	})
}

func (kv *lossyKV) Delete(key string, rev uint64, timeout time.Duration, done func(error)) {
	kv.rt.AfterFunc(time.Millisecond, func() { kv.write(key, nil, true); done(nil) })
}

func (kv *lossyKV) Put(key string, val []byte, timeout time.Duration, done func(uint64, error)) {
	kv.rt.AfterFunc(time.Millisecond, func() {
		r := kv.write(key, val, false)
		kv.rt.AfterFunc(time.Millisecond, func() { done(r, nil) })
	})
}

func (kv *lossyKV) Get(key string, timeout time.Duration, done func(Entry, error)) {
	kv.rt.AfterFunc(time.Millisecond, func() { done(Entry{}, ErrNotFound) })
}

// servedHost records, per partition, until when it is served
// (monotonic instants of the runner).
type servedHost struct{ until map[int]int64 }

func (h *servedHost) Serve(p int, _ uint64, until int64) { h.until[p] = until }
func (h *servedHost) Unserve(p int)                      { delete(h.until, p) }
func (h *servedHost) Drain(_ int, done func())           { done() }
func (h *servedHost) Dropped(p int)                      { delete(h.until, p) }

// TestRenewalLostIsSentAgainBeforeTheSelfFence: a renewal whose request or
// answer is lost is sent again as soon as its timeout ends, and that
// timeout leaves room for it to land before the self-fence (2/3 of the
// lease after the last renewal): a partition whose every other renewal is
// lost is served without a gap. (With a renewal's timeout of lease/3, a
// lost renewal timed out exactly at the self-fence, and the partition went
// unserved until the retry pause had passed: in the simulation, with 1% of
// messages lost, partitions were unserved 0.65% of the time after the
// faults ended.)
func TestRenewalLostIsSentAgainBeforeTheSelfFence(t *testing.T) {
	const lease = 600 * time.Millisecond
	for _, tc := range []struct {
		name string
		drop func(int) bool
	}{
		{"every other renewal lost", func(n int) bool { return n%2 == 1 }},
		{"no renewal lost", func(int) bool { return false }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := &manualRT{now: time.Unix(1_780_000_000, 0)}
			host := &servedHost{until: map[int]int64{}}
			kv := &lossyKV{rt: clock, revs: map[string]uint64{}, drop: tc.drop}
			r := NewRunner(Config{Self: "a", Parts: 1, Lease: lease, KV: kv, Host: host, Runtime: clock})
			kv.r = r
			r.Ready()
			var tick func()
			tick = func() {
				r.Tick()
				clock.AfterFunc(lease/15, tick)
			}
			clock.AfterFunc(lease/15, tick)
			start := clock.now
			served := false
			for step := time.Duration(0); step < 20*lease; step += time.Millisecond {
				clock.run(start.Add(step))
				until, ok := host.until[0]
				switch {
				case ok && r.Mono() < until:
					served = true
				case served:
					t.Fatalf("%v after the start (%d renewals sent): partition 0 not served (%s)",
						step, kv.renewals, r.Describe(0))
				}
			}
			if !served || kv.renewals < 20 {
				t.Fatalf("served %v, %d renewals: the partition was never claimed and renewed", served, kv.renewals)
			}
		})
	}
}
