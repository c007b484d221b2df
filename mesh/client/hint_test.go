package client

import (
	"strconv"
	"testing"
)

func TestHintCache(t *testing.T) {
	c := newHintCache(2)
	c.remember("a", "rl", "7")
	if got := c.subject("a"); got != "rl.v1.shard.7" {
		t.Fatalf("subject = %q", got)
	}
	c.remember("a", "rl", "12") // the partition changed (policy change)
	if got := c.subject("a"); got != "rl.v1.shard.12" {
		t.Fatalf("after a change: %q", got)
	}
	c.remember("b", "rl", "1")
	c.subject("a") // a is now the most recent
	c.remember("c", "rl", "2")
	if c.subject("b") != "" || c.subject("a") == "" || c.len() != 2 {
		t.Fatalf("LRU: b %q a %q len %d", c.subject("b"), c.subject("a"), c.len())
	}
	c.forget("a")
	if c.subject("a") != "" {
		t.Fatal("forgotten hint still used")
	}
	for _, bad := range []string{"", "-1", "x", "1.5", strconv.Itoa(maxPartition)} {
		c.remember("bad", "rl", bad)
		if c.subject("bad") != "" {
			t.Fatalf("header %q accepted", bad)
		}
	}
}

func TestPartitionHintsOption(t *testing.T) {
	if _, err := New(nil, PartitionHints(-1)); err == nil {
		t.Fatal("nil connection accepted")
	}
	var o options
	if err := PartitionHints(-1)(&o); err == nil {
		t.Fatal("negative hints accepted")
	}
	if err := PartitionHints(0)(&o); err != nil || o.hints != 0 {
		t.Fatalf("PartitionHints(0): %v %d", err, o.hints)
	}
}
