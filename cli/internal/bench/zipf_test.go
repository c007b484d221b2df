package bench

import (
	"errors"
	"fmt"
	"math"
	"testing"
)

func TestKeyDistErrors(t *testing.T) {
	for _, tc := range []struct {
		n int
		s float64
	}{
		{0, 1.1}, {-1, 0}, {10, -0.5}, {10, math.NaN()}, {10, math.Inf(1)}, {maxTableKeys + 1, 0.9},
	} {
		if _, err := newKeyDist(tc.n, tc.s); !errors.Is(err, errKeyDist) {
			t.Errorf("newKeyDist(%d, %v) = %v, want errKeyDist", tc.n, tc.s, err)
		}
	}
}

func TestKeyPickerOneKey(t *testing.T) {
	for _, s := range []float64{0, 0.5, 1, 1.1, 3} {
		d, err := newKeyDist(1, s)
		if err != nil {
			t.Fatal(err)
		}
		p := d.picker(7, 0)
		for range 1000 {
			if k := p.next(); k != 0 {
				t.Fatalf("--keys 1 --zipf %v drew key %d", s, k)
			}
		}
	}
}

func TestKeyPickerDeterministic(t *testing.T) {
	for _, s := range []float64{0, 0.8, 1.1} {
		d, err := newKeyDist(1000, s)
		if err != nil {
			t.Fatal(err)
		}
		a, b, other := d.picker(42, 3), d.picker(42, 3), d.picker(42, 4)
		differ := false
		for i := range 1000 {
			ka, kb, ko := a.next(), b.next(), other.next()
			if ka != kb {
				t.Fatalf("zipf %v: draw %d: %d != %d with the same seed and stream", s, i, ka, kb)
			}
			if ka < 0 || ka >= 1000 {
				t.Fatalf("zipf %v: key %d out of 0..999", s, ka)
			}
			differ = differ || ka != ko
		}
		if !differ {
			t.Errorf("zipf %v: streams 3 and 4 drew the same 1000 keys", s)
		}
	}
}

// TestKeyPickerFrequencies checks the shape of each distribution: key k
// drawn in proportion to (k+1)^-s, so count(0)/count(1) is near 2^s, and
// uniform when s = 0.
func TestKeyPickerFrequencies(t *testing.T) {
	const n, draws = 100, 200_000
	for _, s := range []float64{0, 0.8, 1, 1.1, 2} {
		d, err := newKeyDist(n, s)
		if err != nil {
			t.Fatal(err)
		}
		p := d.picker(1, 0)
		counts := make([]float64, n)
		for range draws {
			counts[p.next()]++
		}
		var norm float64
		for k := range n {
			norm += math.Pow(float64(k+1), -s)
		}
		for _, k := range []int{0, 1, 2, 9} {
			want := draws * math.Pow(float64(k+1), -s) / norm
			// Five standard deviations of a binomial count.
			tol := 5 * math.Sqrt(want)
			if math.Abs(counts[k]-want) > tol {
				t.Errorf("zipf %v: key %d drawn %v times, want %.0f ± %.0f", s, k, counts[k], want, tol)
			}
		}
	}
}

func BenchmarkKeyPicker(b *testing.B) {
	for _, s := range []float64{0, 0.8, 1.1} {
		d, err := newKeyDist(10000, s)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(fmt.Sprintf("zipf=%v", s), func(b *testing.B) {
			p := d.picker(1, 0)
			b.ReportAllocs()
			for b.Loop() {
				p.next()
			}
		})
	}
}
