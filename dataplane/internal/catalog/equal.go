package catalog

import (
	"fmt"

	"google.golang.org/protobuf/proto"
)

func eqMaps[K comparable, V proto.Message](what string, a, b map[K]V) error {
	if len(a) != len(b) {
		return fmt.Errorf("%d %ss, want %d", len(a), what, len(b))
	}
	for k, av := range a {
		bv, ok := b[k]
		if !ok {
			return fmt.Errorf("%s %v is missing from the other catalog", what, k)
		}
		if !proto.Equal(av, bv) {
			return fmt.Errorf("%s %v differs:\n%v\nvs\n%v", what, k, av, bv)
		}
	}
	return nil
}
