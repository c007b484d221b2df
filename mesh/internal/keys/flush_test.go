package keys

import "testing"

// TestFlushWheel steps the ring tick by tick: an entry is due at the
// flushSlots-th tick after it was added; the first add of an idle wheel
// asks for the goroutine, and the wheel stops at a tick that finds it
// empty.
func TestFlushWheel(t *testing.T) {
	var w flushWheel
	e := &Entry{}
	type step struct {
		add   []string // added before the tick
		start []bool   // add's result, per added key
		due   []string // due at the tick
		stop  bool
	}
	steps := []step{
		{add: []string{"a", "b"}, start: []bool{true, false}},
		{add: []string{"c"}, start: []bool{false}},
		{},
		{due: []string{"a", "b"}},
		{due: []string{"c"}},
		{stop: true},
		{add: []string{"d"}, start: []bool{true}},
		{},
		{add: []string{"a"}, start: []bool{false}},
		{due: []string{"d"}},
		{},
		{due: []string{"a"}},
		{stop: true},
	}
	for i, s := range steps {
		for j, k := range s.add {
			if got := w.add(k, e); got != s.start[j] {
				t.Fatalf("step %d: add(%s) start %v, want %v", i, k, got, s.start[j])
			}
		}
		due, stop := w.tick()
		var keys []string
		for _, f := range due {
			if f.e != e {
				t.Fatalf("step %d: entry %+v lost its Entry", i, f)
			}
			keys = append(keys, f.key)
		}
		if stop != s.stop || len(keys) != len(s.due) {
			t.Fatalf("step %d: due %v stop %v, want %v %v", i, keys, stop, s.due, s.stop)
		}
		for j := range keys {
			if keys[j] != s.due[j] {
				t.Fatalf("step %d: due %v, want %v", i, keys, s.due)
			}
		}
		w.recycle(due)
	}
}
