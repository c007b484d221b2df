package shadow

// The series of a summary: counts per SeriesStepUs of record time.
const (
	SeriesStepUs = 10_000_000 // width of one series bucket, µs of record time (10 s)
	SeriesLen    = 60         // most buckets a series keeps (10 minutes)
)

// series keeps the last SeriesLen buckets of counts, by record time. A
// record older than the oldest bucket kept is not in the series (it still
// counts in the summary's totals); a record newer than the newest bucket
// starts the buckets up to its own, dropping the oldest beyond SeriesLen.
// Buckets without records in between are kept as zeros, so the points are
// evenly spaced.
type series struct {
	points []Point // oldest first, consecutive buckets
}

// add counts one evaluated record at tUs.
func (s *series) add(tUs int64, wouldDeny, liveDenied bool) {
	start := tUs - floorMod(tUs, SeriesStepUs)
	p := s.bucket(start)
	if p == nil {
		return
	}
	p.Evaluated++
	if wouldDeny {
		p.WouldDeny++
	}
	if liveDenied {
		p.LiveDenied++
	}
}

// bucket returns the bucket starting at start, creating it (and the empty
// ones before it) when it is newer than the newest; nil when it is older
// than the oldest kept.
func (s *series) bucket(start int64) *Point {
	if len(s.points) == 0 {
		s.points = append(s.points, Point{TimeUs: start})
		return &s.points[0]
	}
	first := s.points[0].TimeUs
	if start < first {
		return nil
	}
	i := (start - first) / SeriesStepUs
	if i < int64(len(s.points)) {
		return &s.points[i]
	}
	last := s.points[len(s.points)-1].TimeUs
	if gap := (start - last) / SeriesStepUs; gap > SeriesLen {
		// A jump longer than the whole series: start over.
		s.points = append(s.points[:0], Point{TimeUs: start})
		return &s.points[0]
	}
	for t := last + SeriesStepUs; t <= start; t += SeriesStepUs {
		s.points = append(s.points, Point{TimeUs: t})
	}
	if n := len(s.points) - SeriesLen; n > 0 {
		s.points = append(s.points[:0], s.points[n:]...)
	}
	return &s.points[len(s.points)-1]
}

// floorMod is a mod m in [0, m).
func floorMod(a, m int64) int64 {
	r := a % m
	if r < 0 {
		r += m
	}
	return r
}
