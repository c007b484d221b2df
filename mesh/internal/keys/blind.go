package keys

import "sync/atomic"

// blindScore says whether new owners may try a blind create (owner.go):
// it rises when a key read for the first time is absent or a blind
// create wins, and falls (faster) when such a key exists or a blind
// create loses, within ±blindScoreMax. Blind creates are tried while it
// is positive, so after a handoff of existing keys they stop after a few
// losses, and with new keys they save each key's first read. It is safe
// for concurrent use; a new table's starts at blindScoreStart.
type blindScore struct{ v atomic.Int64 }

const (
	blindScoreMax   = 16
	blindScoreStart = 4
)

// allows reports whether a new owner may start with a blind create.
func (b *blindScore) allows() bool { return b.v.Load() > 0 }

// vote moves the score by d within its bounds.
func (b *blindScore) vote(d int64) {
	for {
		v := b.v.Load()
		nv := min(max(v+d, -blindScoreMax), blindScoreMax)
		if nv == v || b.v.CompareAndSwap(v, nv) {
			return
		}
	}
}
