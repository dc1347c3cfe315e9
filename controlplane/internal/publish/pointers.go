// Pointers: each region's KV entry naming the snapshot it runs.

package publish

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// writePointers writes the KV entry of the given regions (all with all),
// skipping unchanged ones. It reports whether some region lacks a
// position for its version (a new compile fixes that).
func (p *Publisher) writePointers(ctx context.Context, all bool, some map[string]bool) (bool, error) {
	kv, err := p.js.KeyValue(ctx, wire.PointerBucket)
	if err != nil {
		return false, fmt.Errorf("pointer bucket: %w", err)
	}
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return false, err
	}
	needCompile := false
	for _, r := range regions {
		if !all && !some[r.Name] {
			continue
		}
		ptr, err := p.store.RegionPointer(ctx, r.Name)
		if errors.Is(err, store.ErrNoPosition) {
			needCompile = true
			continue
		}
		if err != nil {
			return false, err
		}
		msg := &configv1.SnapshotPointer{Version: uint64(ptr.Version), Digest: ptr.Digest, EventsSeq: uint64(ptr.EventsSeq),
			RegionSeq: uint64(ptr.RegionSeq), Object: ptr.Object, Rollback: ptr.Rollback}
		p.mu.Lock()
		same := proto.Equal(p.pointers[r.Name], msg)
		p.mu.Unlock()
		if same {
			continue
		}
		data, err := proto.Marshal(msg)
		if err != nil {
			return false, err
		}
		if _, err := kv.Put(ctx, wire.PointerKey(r.Name), data); err != nil {
			return false, fmt.Errorf("write pointer of region %s: %w", r.Name, err)
		}
		p.mu.Lock()
		p.pointers[r.Name] = msg
		p.mu.Unlock()
		p.log.Info("region pointer", "region", r.Name, "version", ptr.Version, "region_seq", ptr.RegionSeq, "rollback", ptr.Rollback)
	}
	return needCompile, nil
}
