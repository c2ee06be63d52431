"""The executor's parts, by concern: the caller's arrays and streams (:mod:`.interop`), the layer's
device tensors and binding table (:mod:`.tensors`), scratch pools (:mod:`.scratch`), plans and their
bound launches (:mod:`.plan`), graphs (:mod:`.graph`). :class:`qmoe_rtc.QMoE` puts them together."""
