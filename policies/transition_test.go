package policies

import (
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

const (
	u   = kvstate.Unit
	sec = kvstate.Second
)

func tbLimit(name string, ratePerSec, burst int64) NamedLimit {
	return NamedLimit{Name: name, Limit: kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: ratePerSec * u, Burst: burst * u}}
}

func tbAt(tokens, last int64) kvstate.State {
	return kvstate.State{Algorithm: kvstate.TokenBucket, Tokens: tokens, Last: last}
}

func TestTransition(t *testing.T) {
	fw := NamedLimit{Name: "win", Limit: kvstate.Limit{Algorithm: kvstate.FixedWindow, Limit: 10 * u, Window: 60 * sec}}
	tests := []struct {
		name      string
		old, new  []NamedLimit
		states    []kvstate.State
		at        int64
		wantAt    int64 // instant at which to inspect each result, advanced under new
		wantToken []int64
	}{
		{
			name: "lowered capacity clamps stored tokens",
			old:  []NamedLimit{tbLimit("r", 1, 10)}, new: []NamedLimit{tbLimit("r", 1, 5)},
			states: []kvstate.State{tbAt(8*u, 0)}, at: sec, wantAt: sec,
			wantToken: []int64{5 * u},
		},
		{
			name: "raised capacity adds no tokens",
			old:  []NamedLimit{tbLimit("r", 1, 5)}, new: []NamedLimit{tbLimit("r", 1, 10)},
			states: []kvstate.State{tbAt(5*u, 0)}, at: 0, wantAt: 0,
			wantToken: []int64{5 * u},
		},
		{
			name: "rate change refills under the old rate up to at",
			old:  []NamedLimit{tbLimit("r", 1, 100)}, new: []NamedLimit{tbLimit("r", 3, 100)},
			states: []kvstate.State{tbAt(0, 0)}, at: 2 * sec, wantAt: 3 * sec,
			wantToken: []int64{(2 + 3) * u}, // 2 s at 1/s, then 1 s at 3/s
		},
		{
			name:   "limits matched by name, in new's order; added start fresh; removed dropped",
			old:    []NamedLimit{tbLimit("gone", 1, 10), tbLimit("a", 1, 10), tbLimit("b", 1, 10)},
			new:    []NamedLimit{tbLimit("b", 1, 10), tbLimit("new", 1, 7), tbLimit("a", 1, 10)},
			states: []kvstate.State{tbAt(1*u, 0), tbAt(2*u, 0), tbAt(3*u, 0)}, at: 0, wantAt: 0,
			wantToken: []int64{3 * u, 7 * u, 2 * u}, // fresh buckets start full
		},
		{
			name:   "states shorter than old limits: the missing ones are never seen",
			old:    []NamedLimit{tbLimit("a", 1, 10), tbLimit("b", 1, 10)},
			new:    []NamedLimit{tbLimit("a", 1, 10), tbLimit("b", 1, 4)},
			states: []kvstate.State{tbAt(1*u, 0)}, at: 0, wantAt: 0,
			wantToken: []int64{1 * u, 4 * u},
		},
		{
			name: "algorithm change starts fresh",
			old:  []NamedLimit{{Name: "r", Limit: fw.Limit}}, new: []NamedLimit{tbLimit("r", 1, 6)},
			states: []kvstate.State{{Algorithm: kvstate.FixedWindow, WindowStart: 0, Count: 10 * u}}, at: sec, wantAt: sec,
			wantToken: []int64{6 * u},
		},
		{
			name: "no old policy: everything fresh",
			old:  nil, new: []NamedLimit{tbLimit("a", 1, 9)},
			states: []kvstate.State{tbAt(1*u, 0)}, at: 0, wantAt: 0,
			wantToken: []int64{9 * u},
		},
	}
	for _, tt := range tests {
		var oldP *Policy
		if tt.old != nil {
			oldP = &Policy{Name: "p", Limits: tt.old}
		}
		newP := &Policy{Name: "p", Limits: tt.new}
		in := append([]kvstate.State(nil), tt.states...)
		got := Transition(oldP, newP, tt.states, tt.at)
		if len(got) != len(tt.new) {
			t.Errorf("%s: %d states for %d limits", tt.name, len(got), len(tt.new))
			continue
		}
		for i, s := range got {
			// Inspect through the kvstate API: advance to wantAt under the
			// new limit and read the credit a token bucket holds.
			a := kvstate.Advance(tt.new[i].Limit, s, tt.wantAt)
			tokens := a.Tokens
			if a.Algorithm == 0 { // never seen: full
				tokens = tt.new[i].Burst
			}
			if tokens != tt.wantToken[i] {
				t.Errorf("%s: limit %s has %d micro-units at %d, want %d (state %+v)", tt.name, tt.new[i].Name, tokens, tt.wantAt, tt.wantToken[i], s)
			}
		}
		for i := range in {
			if in[i].Tokens != tt.states[i].Tokens || in[i].Last != tt.states[i].Last {
				t.Errorf("%s: Transition modified its input", tt.name)
			}
		}
	}
}

func TestTransitionWindowKeepsCount(t *testing.T) {
	old := &Policy{Name: "p", Limits: []NamedLimit{{Name: "w", Limit: kvstate.Limit{Algorithm: kvstate.FixedWindow, Limit: 10 * u, Window: 60 * sec}}}}
	lowered := &Policy{Name: "p", Limits: []NamedLimit{{Name: "w", Limit: kvstate.Limit{Algorithm: kvstate.FixedWindow, Limit: 5 * u, Window: 60 * sec}}}}
	s := []kvstate.State{{Algorithm: kvstate.FixedWindow, WindowStart: 0, Count: 6 * u}}
	got := Transition(old, lowered, s, 10*sec)
	// 6 already spent in this window against a new limit of 5: denied until the window ends.
	d, _ := kvstate.Decide(lowered.Limits[0].Limit, got[0], 10*sec, u)
	if d.Allowed {
		t.Errorf("lowered window limit admitted after 6 of 5 were spent: %+v", got[0])
	}
	d, _ = kvstate.Decide(lowered.Limits[0].Limit, got[0], 60*sec, u)
	if !d.Allowed {
		t.Errorf("next window denied: %+v", d)
	}
}
