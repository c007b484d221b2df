package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
)

// The memory of a bench run: this process's peak resident memory (the
// kernel's high-water mark, VmHWM in /proc/self/status) when the report is
// made, and with --memprofile a heap profile taken at the end of the decide
// phase. With the embedded node, both cover the node and its NATS server
// (the JetStream stores' caches included), so runs with and without
// --usage are compared by them.

// writeHeapProfile writes a heap profile to path (nothing when path is
// empty), after a garbage collection, so that its in-use figures are those
// of the moment it is written rather than of the last collection.
func writeHeapProfile(path string) error {
	if path == "" {
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("--memprofile: %v", err)
	}
	runtime.GC()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		f.Close()
		return fmt.Errorf("--memprofile: %v", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("--memprofile: %v", err)
	}
	return nil
}

// peakRSSMB returns this process's peak resident memory in MB (10^6
// bytes), rounded to 0.1; nil where /proc/self/status cannot be read (not
// Linux).
func peakRSSMB() *float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return nil
	}
	kb, ok := statusKB(b, "VmHWM")
	if !ok {
		return nil
	}
	mb := math.Round(float64(kb)*1024/1e5) / 10
	return &mb
}

// statusKB returns the value of field (for example "VmHWM") in the text
// of /proc/<pid>/status, in kB as the kernel writes it ("VmHWM:  123 kB").
func statusKB(status []byte, field string) (int64, bool) {
	sc := bufio.NewScanner(bytes.NewReader(status))
	for sc.Scan() {
		name, rest, ok := bytes.Cut(sc.Bytes(), []byte(":"))
		if !ok || string(name) != field {
			continue
		}
		num, unit, _ := bytes.Cut(bytes.TrimSpace(rest), []byte(" "))
		if string(bytes.TrimSpace(unit)) != "kB" {
			return 0, false
		}
		v, err := strconv.ParseInt(string(num), 10, 64)
		return v, err == nil
	}
	return 0, false
}
