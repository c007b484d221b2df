package client

import (
	"container/list"
	"fmt"
	"strconv"
	"strings"
	"sync"
)

// PartitionHeader is the reply header in which nodes before 0.3 named the
// partition of the descriptor's limit key; nodes now send it in the reply's
// optional "partition" field (docs/protocol.md, an extension of
// CONTRACT.md §2), and the client accepts either. It remembers the
// partition per descriptor and sends that descriptor's next requests
// straight to "<prefix>.v1.shard.<n>", the subject only the partition's
// owner subscribes to, saving the node to node hop.
const PartitionHeader = "Limitmesh-Partition"

// DefaultPartitionHints is the default number of descriptors whose
// partition the client remembers (see [PartitionHints]).
const DefaultPartitionHints = 10_000

// maxPartition bounds the partition numbers the client accepts from a reply.
const maxPartition = 1 << 16

// PartitionHints sets how many descriptors' partitions the client
// remembers, least recently used evicted (default [DefaultPartitionHints]);
// 0 turns the direct-to-owner routing off (every request goes to
// "<prefix>.v1.decide").
func PartitionHints(n int) Option {
	return func(o *options) error {
		if n < 0 {
			return fmt.Errorf("limitmesh client: partition hints %d must not be negative", n)
		}
		o.hints = n
		return nil
	}
}

// hintCache maps descriptor keys to partitions (a bounded LRU).
type hintCache struct {
	mu    sync.Mutex
	max   int
	ll    *list.List // of *hint, most recent at the front
	items map[string]*list.Element
}

type hint struct {
	key     string
	subject string
}

func newHintCache(max int) *hintCache {
	return &hintCache{max: max, ll: list.New(), items: make(map[string]*list.Element)}
}

// subject returns the shard subject remembered for key, or "".
func (c *hintCache) subject(key string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.ll.MoveToFront(e)
		return e.Value.(*hint).subject
	}
	return ""
}

// remember records the partition header value part for key; prefix is the
// subject prefix. An invalid value is ignored.
func (c *hintCache) remember(key, prefix, part string) {
	n, err := strconv.Atoi(part)
	if err != nil || n < 0 || n >= maxPartition {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.ll.MoveToFront(e)
		if h := e.Value.(*hint); !strings.HasSuffix(h.subject, "."+part) {
			h.subject = prefix + ".v1.shard." + part
		}
		return
	}
	c.items[key] = c.ll.PushFront(&hint{key: key, subject: prefix + ".v1.shard." + part})
	for c.ll.Len() > c.max {
		last := c.ll.Back()
		c.ll.Remove(last)
		delete(c.items, last.Value.(*hint).key)
	}
}

// forget drops key's hint.
func (c *hintCache) forget(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.ll.Remove(e)
		delete(c.items, key)
	}
}

func (c *hintCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ll.Len()
}
