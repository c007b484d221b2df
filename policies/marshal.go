package policies

import (
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/limitmesh/limitmesh/kvstate"
)

// MarshalJSON writes p as a canonical policy document that [Parse] reads
// back to an equal Policy (Revision aside, which is not part of the
// document): match sorted by name, key always explicit, every limit named,
// rates as [FormatRate] writes them ("N/s", or "N/m", "N/h", "N/d" for a
// rate kept over that period), burst and limit as JSON numbers with at
// most 6 fractional digits, windows and the lease ttl as Go durations,
// quota periods by name, and mode, max_keys, shadow and description always
// present; a leased policy's lease with all three fields. p is assumed
// valid.
func (p *Policy) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, 256)
	b = append(b, `{"match":{`...)
	for i, d := range p.Match {
		if i > 0 {
			b = append(b, ',')
		}
		b = wire.AppendString(b, d.Name)
		b = append(b, ':')
		b = wire.AppendString(b, d.Value)
	}
	b = append(b, `},"key":[`...)
	for i, k := range p.Key {
		if i > 0 {
			b = append(b, ',')
		}
		b = wire.AppendString(b, k)
	}
	b = append(b, `],"limits":[`...)
	for i, l := range p.Limits {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"name":`...)
		b = wire.AppendString(b, l.Name)
		b = append(b, `,"algorithm":`...)
		b = wire.AppendString(b, l.Algorithm.String())
		switch {
		case l.Algorithm.Bucket():
			b = append(b, `,"rate":"`...)
			b = appendRate(b, l.Limit)
			b = append(b, `","burst":`...)
			b = appendMicro(b, l.Burst)
		case l.Algorithm == kvstate.Quota:
			b = append(b, `,"limit":`...)
			b = appendMicro(b, l.Limit.Limit)
			b = append(b, `,"period":"`...)
			b = append(b, l.Period.String()...)
			b = append(b, '"')
		case l.Algorithm != 0:
			b = append(b, `,"limit":`...)
			b = appendMicro(b, l.Limit.Limit)
			b = append(b, `,"window":"`...)
			b = append(b, time.Duration(l.Window).String()...)
			b = append(b, '"')
		}
		b = append(b, '}')
	}
	b = append(b, `],"mode":"`...)
	b = append(b, p.Mode.String()...)
	b = append(b, `",`...)
	if p.Mode == ModeLeased {
		b = append(b, `"lease":{"size":`...)
		b = appendMicro(b, p.Lease.Size)
		b = append(b, `,"ttl":"`...)
		b = append(b, p.Lease.TTL.String()...)
		b = append(b, `","max_outstanding":`...)
		b = appendMicro(b, p.Lease.MaxOutstanding)
		b = append(b, `},`...)
	}
	if p.Layer != "" {
		b = append(b, `"layer":`...)
		b = wire.AppendString(b, p.Layer)
		b = append(b, ',')
	}
	b = append(b, `"max_keys":`...)
	b = strconv.AppendInt(b, p.MaxKeys, 10)
	b = append(b, `,"shadow":`...)
	if p.Shadow {
		b = append(b, "true"...)
	} else {
		b = append(b, "false"...)
	}
	b = append(b, `,"description":`...)
	b = wire.AppendString(b, p.Description)
	return append(b, '}'), nil
}
