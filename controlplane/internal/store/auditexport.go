package store

import (
	"context"
	"fmt"
)

// AuditExportPosition is the sequence of the last audit record the
// audit export stream acknowledged (0: none).
func (s *Store) AuditExportPosition(ctx context.Context) (int64, error) {
	n, err := s.q.AuditExportPosition(ctx, s.pool)
	if err != nil {
		return 0, fmt.Errorf("read audit export position: %w", err)
	}
	return n, nil
}

// AuditExportAdvance moves the audit export position to seq; it never
// moves it back.
func (s *Store) AuditExportAdvance(ctx context.Context, seq int64) error {
	if err := s.q.AuditExportAdvance(ctx, s.pool, seq); err != nil {
		return fmt.Errorf("advance audit export position to %d: %w", seq, err)
	}
	return nil
}
