package integration

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestLeasedKillOwnerProcess: three serve processes, a leased key, four
// SDK gateways on the two processes that do not own the key's partition,
// spending under load above the contract. The owner's process gets
// SIGKILL with grants outstanding (its NATS server dies with it). The
// partition's next owner takes the grants over from the journal: the whole
// run admits at most burst + rate × elapsed + max_outstanding, and the
// gateways admit again after the kill.
func TestLeasedKillOwnerProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	procs := startProcs(t, procSpec{n: 3})
	urls := clientURLs(procs)
	admin := connectURLs(t, urls...)
	d := map[string]string{"tenant": "killed"}
	// The key's partition: a strict version of the policy answers dry runs
	// with the partition hint (a leased key's replies carry none); the
	// limit key, and so the partition, is the same in either mode.
	strict := `{"match": {"tenant": "*"}, "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "10/s", "burst": 40}]}`
	rev := putPolicy(t, admin, "rl_policies", "leased", strict)
	waitProcsApplied(t, "leased", rev, procs...)
	hint := decide(t, admin, "rl.v1.decide", req(d, `"dry_run":true`))
	part := hint.Partition
	if hint.Code != "" || part < 0 {
		t.Fatalf("dry run %+v: want a decision with the partition hint", hint)
	}
	rev = putPolicy(t, admin, "rl_policies", "leased", leasedPolicy)
	waitProcsApplied(t, "leased", rev, procs...)

	owner := -1
	waitFor(t, "an owner of the key's partition", func() bool {
		owner = procOfNode(t, procs, partOwner(admin, part))
		return owner >= 0
	})
	var survivors []string
	for i := range procs {
		if i != owner {
			survivors = append(survivors, procs[i].clientURL)
		}
	}
	gws := gateways(t, 4, func(i int) *nats.Conn { return connectURLs(t, survivors[i%2]) })
	before, after := &tally{}, &tally{}
	stop := make(chan struct{})
	start := time.Now()
	wg := loadGateways(gws, d, time.Millisecond, before, stop)
	waitFor(t, "admissions before the kill", func() bool { a, _, local, _ := before.get(); return a >= 20 && local > 0 })

	procs[owner].kill()
	killedAt := time.Now()
	close(stop)
	wg.Wait()
	stop2 := make(chan struct{})
	wg2 := loadGateways(gws, d, time.Millisecond, after, stop2)
	newOwner := -1
	survivor := connectURLs(t, survivors...)
	waitWithin(t, faultTimeout, fmt.Sprintf("a new owner of partition %d", part), func() bool {
		newOwner = procOfNode(t, procs, partOwner(survivor, part))
		return newOwner >= 0 && newOwner != owner
	})
	// Admissions resume, and go on for longer than a grant lives (the old
	// owner's grants expire within it).
	waitWithin(t, faultTimeout, "admissions after the kill", func() bool { a, _, _, _ := after.get(); return a >= 20 })
	resumed := time.Since(killedAt)
	time.Sleep(3 * time.Second) // the load's length, not a wait for state
	close(stop2)
	wg2.Wait()
	elapsed := time.Since(start).Seconds()

	var admitted int
	for _, tl := range []*tally{before, after} {
		a, dn, local, errs := tl.get()
		t.Logf("admitted %d, denied %d, local %d, errors %d (first: %v)", a, dn, local, errs, tl.firstErr)
		admitted += a
	}
	t.Logf("owner %s killed; partition %d now owned by %s; 20 admissions again %s after the kill",
		procs[owner].name, part, procs[newOwner].name, resumed.Round(time.Millisecond))
	if limit := leasedBurst + leasedRate*elapsed + leasedBound; float64(admitted) > limit {
		t.Fatalf("admitted %d in %.2fs, above the contract plus the bound (%.1f)", admitted, elapsed, limit)
	}
	t.Logf("admitted %d in %.2fs: contract %.0f + bound %.0f", admitted, elapsed, leasedBurst+leasedRate*elapsed, leasedBound)
	if _, _, local, _ := after.get(); local == 0 {
		t.Errorf("no decision after the kill was spent from a grant: the new owner grants nothing")
	}
}
